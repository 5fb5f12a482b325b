"""`str_replace_editor`: view, create, str_replace, insert, undo_edit (SWE-agent / OpenHands
semantics). Every file operation runs inside the agent's sandbox as its uid (see
tools/editor_helper.py); the host only keeps the per-file undo history of each agent.
"""

from __future__ import annotations

import base64
import binascii
import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .core import Observation, ToolContext, cap
from .editor_helper import RESULT_MARK, EditorError, normalize

HELPER_SOURCE = (Path(__file__).resolve().parent / "editor_helper.py").read_text(encoding="utf-8")
# -I: isolated (no cwd, no PYTHON* variables, no user site): nothing from the workspace is
# imported into the helper. -B: no bytecode.
HELPER_COMMAND = f"/usr/bin/python3 -I -B -c {shlex.quote(HELPER_SOURCE)}"
MAX_EDIT_BYTES = 4 * 2**20  # largest file the editor reads whole (view streams any size)
HISTORY_PER_FILE = 10  # undo steps kept per file
HISTORY_BYTES = 64 * 2**20  # per agent, all files together; the oldest steps go first
COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")

DESCRIPTION = """Custom editing tool for viewing, creating and editing files in the workspace.
* State is persistent across calls.
* `view` on a file shows it with line numbers (like `cat -n`); on a directory it lists files and directories up to 2 levels deep (hidden ones excluded). `view_range` [start, end] shows only those lines (1-based, inclusive; end -1 = to the end).
* `create` makes a new file with `file_text` (parent directories are created); it cannot overwrite an existing file.
* `str_replace` replaces `old_str` with `new_str` (default: empty). `old_str` must match EXACTLY ONE place in the file, whitespace and indentation included; include enough context lines to make it unique.
* `insert` inserts `new_str` AFTER line `insert_line` (0: at the beginning).
* `undo_edit` reverts the last edit made to the file at `path` with this tool.
* Paths are absolute inside the workspace (e.g. /work/src/app.py) or relative to it."""  # noqa: E501


def _history(ctx: ToolContext) -> dict[str, list[str | None]]:
    return ctx.state.setdefault("editor_history", {})


def _trim(hist: dict[str, list[str | None]]) -> None:
    """Keep the history within HISTORY_BYTES, dropping the oldest step of the longest-held
    files first."""
    size = sum(len(c or "") for steps in hist.values() for c in steps)
    for steps in hist.values():
        while size > HISTORY_BYTES and steps:
            size -= len(steps.pop(0) or "")


def _remember(hist: dict[str, list[str | None]], key: str, res: dict[str, Any]) -> None:
    """Keep the content an edit replaced (from the helper's reply) as an undo step."""
    old = None
    if res.get("old_b64") is not None:
        try:
            old = base64.b64decode(res["old_b64"]).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            old = None
    if old is not None or not res.get("existed", True):
        steps = hist.setdefault(key, [])
        steps.append(old)  # None: the edit created the file; undo removes it
        del steps[:-HISTORY_PER_FILE]
        _trim(hist)


@dataclass
class StrReplaceEditor:
    name: str = "str_replace_editor"
    description: str = DESCRIPTION
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "enum": list(COMMANDS),
                    "description": "The command to run: " + ", ".join(COMMANDS) + ".",
                },
                "path": {
                    "type": "string",
                    "description": "Absolute path in the workspace (e.g. /work/file.py), or "
                    "relative to it.",
                },
                "file_text": {
                    "type": "string",
                    "description": "`create`: the content of the new file.",
                },
                "old_str": {
                    "type": "string",
                    "description": "`str_replace`: the exact text to replace (one match).",
                },
                "new_str": {
                    "type": "string",
                    "description": "`str_replace`: the replacement (default empty); "
                    "`insert`: the text to insert.",
                },
                "insert_line": {
                    "type": "integer",
                    "description": "`insert`: insert after this line (0 = at the beginning).",
                },
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "`view` of a file: [start, end] lines, 1-based, inclusive; "
                    "end -1 = to the end of the file.",
                },
            },
            "required": ["command", "path"],
        }
    )

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        cmd = args.get("command")
        if cmd not in COMMANDS:
            return Observation(
                f"str_replace_editor: unknown command {cmd!r}; use one of {', '.join(COMMANDS)}.",
                ok=False,
            )
        root = ctx.sandbox.workdir(ctx.workspace)
        try:
            key = normalize(root, args.get("path"))
        except EditorError as e:
            return Observation(str(e), ok=False)
        if cmd == "undo_edit":
            return await self._undo(key, root, ctx)
        req = {k: v for k, v in args.items() if k != "command"}
        req.update(command=cmd, path=key)
        res = await self._helper(req, root, ctx)
        if res["ok"] and cmd != "view":
            _remember(_history(ctx), key, res)
        return Observation(cap(res["text"]), ok=bool(res["ok"]))

    async def _undo(self, key: str, root: str, ctx: ToolContext) -> Observation:
        steps = _history(ctx).get(key)
        if not steps:
            return Observation(f"No edit history found for {key}.", ok=False)
        prev = steps.pop()
        req: dict[str, Any] = {"command": "restore", "path": key}
        req["content_b64"] = (
            None if prev is None else base64.b64encode(prev.encode("utf-8")).decode()
        )
        res = await self._helper(req, root, ctx)
        if not res["ok"]:
            steps.append(prev)  # nothing was undone: keep the step
        return Observation(cap(res["text"]), ok=res["ok"])

    async def _helper(self, req: dict[str, Any], root: str, ctx: ToolContext) -> dict[str, Any]:
        """Run one request in the sandbox. Failures of the sandbox itself become replies."""
        req = {**req, "root": root, "max_chars": 16000, "max_bytes": MAX_EDIT_BYTES}
        limits = replace(ctx.limits, output_bytes=2 * MAX_EDIT_BYTES + 2**20)
        stdin = json.dumps(req, ensure_ascii=True)  # lone surrogates stay encodable
        try:
            r = await ctx.sandbox.run(HELPER_COMMAND, ctx.workspace, ctx.uid, limits, stdin=stdin)
        except OSError as e:
            return {"ok": False, "text": f"str_replace_editor: could not run: {e}"}
        head, mark, body = r.output.rpartition(RESULT_MARK)
        if mark:
            try:
                res = json.loads(body)
                if isinstance(res, dict) and isinstance(res.get("text"), str):
                    return res
            except json.JSONDecodeError:
                pass
        if r.timed_out:
            why = f"timed out after {limits.timeout_s:g}s"
        elif r.killed == "workspace":
            why = "killed: the workspace is over its size limit; delete files first"
        else:
            why = f"exit code {r.exit_code}"
        tail = (head or r.output)[-1500:].strip()
        return {
            "ok": False,
            "text": f"str_replace_editor {req['command']} failed ({why})"
            + (f":\n{tail}" if tail else "."),
        }
