"""Tools an agent can call. A tool is a name, a JSON schema and an async call that always
returns an Observation: bad arguments, timeouts and crashes are told to the model, never
raised into the agent loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from .sandbox import ExecResult, Limits, Sandbox

OBSERVATION_CAP = 16 * 1024  # characters handed back to the model per tool call


@dataclass
class ToolContext:
    """What a tool may touch: one agent's workspace, through its sandbox, as its uid."""

    workspace: Path
    uid: int
    sandbox: Sandbox
    limits: Limits = field(default_factory=Limits)
    # Per-agent tool state: the editor's undo history, the git base commit of the workspace
    # ("git_base"), the patch captured at submit ("patch").
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Observation:
    text: str
    ok: bool = True
    submitted: bool = False  # the agent is done
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation: ...


def schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function schema that chat templates take."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


def call_schema(tools: dict[str, Tool]) -> dict[str, Any]:
    """JSON schema of one tool call {"name": ..., "arguments": {...}} to any of `tools`:
    what an engine that constrains decoding lets the model write."""
    return {
        "oneOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
            }
            for t in tools.values()
        ]
    }


def cap(text: str, limit: int = OBSERVATION_CAP) -> str:
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 3 // 4], text[-limit // 4 :]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} characters truncated ...]\n{tail}"


def check_args(tool: Tool, args: dict[str, Any]) -> str | None:
    """A message for the model when `args` do not fit the tool's schema (shallow check)."""
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in args]
    if missing:
        return f"{tool.name}: missing required argument(s) {missing}; expected {list(props)}."
    unknown = [k for k in args if k not in props]
    if unknown:
        return f"{tool.name}: unknown argument(s) {unknown}; expected {list(props)}."
    py = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict}
    for k, v in args.items():
        want = props[k].get("type")
        if want in py and not isinstance(v, py[want]):
            return f"{tool.name}: argument {k!r} must be of type {want}, got {type(v).__name__}."
    return None


def limits_with_timeout(
    name: str, args: dict[str, Any], ctx: ToolContext, max_timeout: float
) -> Limits | Observation:
    """The context's limits, with the call's optional `timeout`; an Observation if invalid."""
    if "timeout" not in args:
        return ctx.limits
    t = args["timeout"]
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= max_timeout:
        return Observation(f"{name}: timeout must be a number in (0, {max_timeout:g}].", ok=False)
    return replace(ctx.limits, timeout_s=float(t))


def result_observation(r: ExecResult, limits: Limits) -> Observation:
    """A command's output with a status line the model can read."""
    if r.timed_out:
        status = f"[killed: timed out after {limits.timeout_s:g}s]"
    elif r.killed == "workspace":
        status = "[killed: the workspace exceeded its size limit]"
    else:
        status = f"[exit code {r.exit_code}]"
    out = r.output if r.output.strip() else "(no output)"
    return Observation(
        cap(f"{out.rstrip()}\n{status}"),
        ok=not r.timed_out and r.exit_code == 0,
        meta={"exit_code": r.exit_code, "timed_out": r.timed_out, "truncated": r.truncated},
    )


@dataclass
class Bash:
    name: str = "bash"
    description: str = (
        "Run a bash command in the task's workspace (the current directory) and return its "
        "output and exit code. No network. Use it to inspect files, edit them (e.g. with "
        "sed or a python3 one-liner) and run tests."
    )
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to run."},
                "timeout": {
                    "type": "integer",
                    "description": "Seconds before the command is killed (default 60).",
                },
            },
            "required": ["command"],
        }
    )
    max_timeout: float = 600.0

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        limits = limits_with_timeout(self.name, args, ctx, self.max_timeout)
        if isinstance(limits, Observation):
            return limits
        try:
            r = await ctx.sandbox.run(args["command"], ctx.workspace, ctx.uid, limits)
        except OSError as e:  # e.g. the host is out of processes: tell the model
            return Observation(f"bash: could not start the command: {e}", ok=False)
        return result_observation(r, limits)


@dataclass
class Submit:
    name: str = "submit"
    description: str = "Finish the task. Call it once the work is done, with a short summary."
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "Summary or final answer."}},
            "required": [],
        }
    )

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        answer = str(args.get("answer", ""))
        text = "Submitted."
        if ctx.state.get("git_base"):  # a git workspace: the patch is part of the result
            from .gitrepo import capture_patch

            patch = await capture_patch(ctx)
            ctx.state["patch"] = patch
            text += f" {patch['summary']}"
        return Observation(text, submitted=True, answer=answer)


def _python() -> Tool:
    from .python_tool import Python

    return Python()


def _editor() -> Tool:
    from .editor import StrReplaceEditor

    return StrReplaceEditor()


REGISTRY: dict[str, Callable[[], Tool]] = {
    "bash": Bash,
    "python": _python,
    "str_replace_editor": _editor,
    "submit": Submit,
}
DEFAULT_TOOLS = ("bash", "python", "str_replace_editor", "submit")


def get_tools(
    names: list[str] | tuple[str, ...], registry: Mapping[str, Callable[[], Tool]] | None = None
) -> dict[str, Tool]:
    """Fresh tools by name from `registry` (default: the production tools). `submit` is
    always added."""
    registry = REGISTRY if registry is None else registry
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; available: {sorted(registry)}")
    tools = {n: registry[n]() for n in names}
    if "submit" not in tools:
        tools["submit"] = Submit()  # an agent must always be able to end
    return tools
