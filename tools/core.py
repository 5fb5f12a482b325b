"""What every tool shares. A tool is a name, a JSON schema and an async call that always
returns an Observation: bad arguments, timeouts and crashes are told to the model, never
raised into the agent loop. The tools themselves live in their own modules (bash.py,
python_tool.py, editor.py, submit.py); registry.py names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from .sandbox import CommandSandbox, ExecResult, Limits

OBSERVATION_CAP = 16 * 1024  # characters handed back to the model per tool call


@dataclass
class ToolContext:
    """What a tool may touch: one agent's workspace, through its sandbox, as its uid."""

    workspace: Path
    uid: int
    sandbox: CommandSandbox
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
    py: dict[str, type | tuple[type, ...]] = {
        "string": str,
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
    }
    for k, v in args.items():
        want = props[k].get("type")
        if want in py and not isinstance(v, py[want]):
            return f"{tool.name}: argument {k!r} must be of type {want}, got {type(v).__name__}."
    return None


def timed_parameters(key: str, description: str, killed: str = "the command") -> dict[str, Any]:
    """JSON schema of a tool that runs one string argument under an optional `timeout`."""
    return {
        "type": "object",
        "properties": {
            key: {"type": "string", "description": description},
            "timeout": {
                "type": "integer",
                "description": f"Seconds before {killed} is killed (default 60).",
            },
        },
        "required": [key],
    }


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
        meta={
            "exit_code": r.exit_code,
            "timed_out": r.timed_out,
            "truncated": r.truncated,
            "workspace_full": r.workspace_full,
        },
    )
