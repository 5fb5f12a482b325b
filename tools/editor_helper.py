"""The file operations of `str_replace_editor`, run INSIDE the agent's sandbox as its uid.

The workspace is attacker-controlled (the model's code can plant symlinks, fifos, huge
files), so these operations never run as root on the host: tools/editor.py executes this
file's source with the sandbox's /usr/bin/python3 (`-I`: nothing from the workspace is
imported) and sends one request as JSON on stdin. The reply is one JSON object on stdout
after RESULT_MARK. Standard library only; no imports from the runner.

Request: {"root": workspace path as the model sees it, "command": ..., "path": ...,
          "file_text" | "old_str" | "new_str" | "insert_line" | "view_range" | "content_b64",
          "max_chars": cap of "text", "max_bytes": largest file to edit}
Reply:   {"ok": bool, "text": message for the model, "path": normalized path,
          "existed": bool, "old_b64": the file's content before the edit (base64) or None}
"""

from __future__ import annotations

import base64
import json
import os
import stat
import sys
from typing import Any

RESULT_MARK = "\x1e\x1eEDITOR-RESULT\x1e\x1e"
SNIPPET_LINES = 4
DIR_DEPTH = 2
DIR_MAX_ENTRIES = 500


class EditorError(Exception):
    """A message for the model."""


def normalize(root: str, path: Any) -> str:
    """The absolute, lexically normalized path the model means; EditorError if it leaves the
    workspace. Pure string work: also used on the host to key the undo history."""
    if not isinstance(path, str) or not path.strip():
        raise EditorError("The `path` parameter is required (a file or directory path).")
    if "\x00" in path:
        raise EditorError("The path must not contain NUL characters.")
    root = os.path.normpath(root)
    full = path if path.startswith("/") else os.path.join(root, path)
    full = os.path.normpath(full)
    if full.startswith("//"):
        full = "/" + full.lstrip("/")
    if not _inside(full, root):
        raise EditorError(
            f"The path {path} is outside the workspace {root}. Use a path inside it, absolute "
            f"(e.g. {root}/file.py) or relative to it (e.g. file.py)."
        )
    return full


def _inside(p: str, root: str) -> bool:
    return p == root or p.startswith(root.rstrip("/") + "/")


def _real(full: str, root: str) -> str:
    """Resolve symlinks; refuse paths that lead outside the workspace."""
    real = os.path.realpath(full)
    real_root = os.path.realpath(root)
    if not _inside(real, real_root):
        raise EditorError(
            f"The path {full} resolves through a symlink to {real}, which is outside the "
            f"workspace {root}; refusing to follow it."
        )
    return real


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start=first))


def _split_keep(text: str) -> list[str]:
    """Lines with their "\\n" kept (only "\\n" splits: str.splitlines also splits on \\r,
    \\x0c, \\u2028, ... which would change the file when joined back)."""
    out, i = [], 0
    while i < len(text):
        j = text.find("\n", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i : j + 1])
        i = j + 1
    return out


def _display(text: str) -> list[str]:
    return [line.rstrip("\n") for line in _split_keep(text)]


def _cap_lines(header: str, lines: list[str], first: int, total: int, max_chars: int) -> str:
    """`cat -n` of lines[first..], cut at whole lines once max_chars is reached."""
    out: list[str] = []
    size = len(header)
    for k, line in enumerate(lines):
        row = f"{first + k:6}\t{line}"
        if size + len(row) + 1 > max_chars and out:
            last = first + k - 1
            out.append(
                f"[... output truncated: showing lines {first}-{last} of {total}; use "
                f"view_range [{last + 1}, ...] to see more ...]"
            )
            break
        out.append(row)
        size += len(row) + 1
    return header + "\n".join(out)


def _read_text(real: str, shown: str, max_bytes: int) -> str:
    st = os.stat(real)
    if stat.S_ISDIR(st.st_mode):
        raise EditorError(
            f"The path {shown} is a directory and only the `view` command can be used on "
            "directories."
        )
    if not stat.S_ISREG(st.st_mode):
        raise EditorError(f"The path {shown} is not a regular file.")
    if st.st_size > max_bytes:
        raise EditorError(
            f"The file {shown} is too large to edit ({st.st_size} bytes; the limit is "
            f"{max_bytes}). Use bash (sed, python3) for it."
        )
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EditorError(
            f"The file {shown} is not UTF-8 text (byte {e.start} cannot be decoded); "
            "str_replace_editor edits text files only. Use bash for binary files."
        ) from None


def _write_text(real: str, text: str, create: bool) -> None:
    data = text.encode("utf-8")  # lone surrogates from the model raise here: reported
    flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else os.O_TRUNC)
    fd = os.open(real, flags, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _snippet(text: str, line: int, n_new: int) -> str:
    """Lines around a change starting at 0-based `line` that spans n_new lines."""
    lines = _display(text)
    start = max(0, line - SNIPPET_LINES)
    end = min(len(lines), line + n_new + SNIPPET_LINES)
    return _numbered(lines[start:end], start + 1)


def _edited(shown: str, snippet: str) -> str:
    return (
        f"The file {shown} has been edited. Here's the result of running `cat -n` on a "
        f"snippet of {shown}:\n{snippet}\nReview the changes and make sure they are as "
        "expected (correct indentation, no duplicate lines, etc). Edit the file again if "
        "necessary."
    )


def view(req: dict[str, Any], full: str, real: str) -> str:
    max_chars = int(req.get("max_chars", 16000))
    vr = req.get("view_range")
    if not os.path.lexists(full):
        raise EditorError(f"The path {full} does not exist. Please provide a valid path.")
    if os.path.isdir(real):
        if vr is not None:
            raise EditorError(
                "The `view_range` parameter is not allowed when `path` points to a directory."
            )
        return _view_dir(full, real, max_chars)
    if not os.path.isfile(real):
        raise EditorError(f"The path {full} is not a regular file or directory.")
    _check_view_range(vr)
    start, end = (vr[0], vr[1]) if vr else (1, -1)
    lines, total = _read_lines(full, real, start, end, max_chars)
    if vr:
        _check_range_in_file(vr, start, end, total)
    if total == 0:
        return f"Here's the result of running `cat -n` on {full}:\n(the file is empty)"
    header = f"Here's the result of running `cat -n` on {full}:\n"
    last = total if end == -1 else min(end, total)
    text = _cap_lines(header, lines, start, total, max_chars)
    if vr and end != -1 and end > total:
        text += f"\n[the file has only {total} lines: showing up to line {last}]"
    return text


def _check_view_range(vr: Any) -> None:
    if vr is not None and (
        not isinstance(vr, list)
        or len(vr) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in vr)
    ):
        raise EditorError(
            "Invalid `view_range`: it should be a list of two integers [start, end] "
            "(1-based, end inclusive; end -1 means to the end of the file)."
        )


def _read_lines(
    full: str, real: str, start: int, end: int, max_chars: int
) -> tuple[list[str], int]:
    """(the lines start..end, up to about max_chars; the file's line count). Streamed: only
    the lines shown are kept."""
    lines: list[str] = []
    total = 0
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        head = f.read(8192)
        if b"\x00" in head:
            raise EditorError(
                f"The file {full} looks binary (it contains NUL bytes); view it with bash "
                "(e.g. `xxd FILE | head`)."
            )
        f.seek(0)
        size = 0
        for raw in f:
            total += 1
            if total >= start and (end == -1 or total <= end) and size <= max_chars:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                lines.append(line)
                size += len(line) + 8
    return lines, total


def _check_range_in_file(vr: list[int], start: int, end: int, total: int) -> None:
    if not 1 <= start <= max(total, 1):
        raise EditorError(
            f"Invalid `view_range`: {vr}. Its first element `{start}` should be within "
            f"the range of lines of the file: [1, {total}]."
        )
    if end != -1 and end < start:
        raise EditorError(
            f"Invalid `view_range`: {vr}. Its second element `{end}` should be larger or "
            f"equal than its first `{start}` (or -1 for the end of the file)."
        )


def _view_dir(full: str, real: str, max_chars: int) -> str:
    rows: list[str] = []
    hidden = 0
    more = 0

    def walk(dir_real: str, dir_shown: str, depth: int) -> None:
        nonlocal hidden, more
        try:
            entries = sorted(os.scandir(dir_real), key=lambda e: e.name)
        except OSError as err:
            rows.append(f"{dir_shown}/ [cannot list: {err.strerror}]")
            return
        for entry in entries:
            if entry.name.startswith("."):
                hidden += 1
                continue
            shown = f"{dir_shown.rstrip('/')}/{entry.name}"
            is_dir = entry.is_dir(follow_symlinks=False)
            if len(rows) >= DIR_MAX_ENTRIES:
                more += 1
                continue
            rows.append(shown + ("/" if is_dir else "@" if entry.is_symlink() else ""))
            if is_dir and depth < DIR_DEPTH:
                walk(entry.path, shown, depth + 1)

    walk(real, full, 1)
    text = (
        f"Here's the files and directories up to {DIR_DEPTH} levels deep in {full}, "
        "excluding hidden items:\n" + "\n".join(rows)
    )
    if more:
        text += f"\n[... {more} more entries not shown; list subdirectories to see them ...]"
    if hidden:
        text += (
            f"\n\n{hidden} hidden files/directories (names starting with '.') are excluded. "
            f"You can use 'ls -la {full}' to see them."
        )
    if len(text) > max_chars:
        text = text[:max_chars] + "\n[... listing truncated ...]"
    return text


def create(req: dict[str, Any], full: str, real: str) -> tuple[str, str | None]:
    text = req.get("file_text")
    if not isinstance(text, str):
        raise EditorError("Parameter `file_text` is required for command: create.")
    if os.path.lexists(full) or os.path.lexists(real):
        if os.path.isdir(real):
            raise EditorError(
                f"The path {full} is a directory and only the `view` command can be used on "
                "directories."
            )
        raise EditorError(
            f"File already exists at: {full}. Cannot overwrite files using command `create`; "
            "use `str_replace` to edit it."
        )
    parent = os.path.dirname(real)
    os.makedirs(parent, exist_ok=True)
    _real(parent, req["root"])  # the parents made must still be inside
    if len(text.encode("utf-8", errors="surrogatepass")) > int(req["max_bytes"]):
        raise EditorError(f"`file_text` is too large (limit {req['max_bytes']} bytes).")
    _write_text(real, text, create=True)
    return f"File created successfully at: {full}", None


def str_replace(req: dict[str, Any], full: str, real: str) -> tuple[str, str | None]:
    old, new = req.get("old_str"), req.get("new_str", "")
    if not isinstance(old, str):
        raise EditorError("Parameter `old_str` is required for command: str_replace.")
    if new is None:
        new = ""
    if not isinstance(new, str):
        raise EditorError("Parameter `new_str` must be a string.")
    if old == "":
        raise EditorError(
            "No replacement was performed: `old_str` is empty. Give the exact text to replace, "
            "including enough surrounding lines to make it unique."
        )
    if old == new:
        raise EditorError("No replacement was performed: `new_str` and `old_str` are identical.")
    _require_file(full, real)
    content = _read_text(real, full, int(req["max_bytes"]))
    count = content.count(old)
    if count == 0 and "\r\n" in content and "\r" not in old and "\n" in old:
        # The file has Windows line endings, which `view` does not show: match them.
        old, new = old.replace("\n", "\r\n"), new.replace("\n", "\r\n")
        count = content.count(old)
    if count == 0:
        raise EditorError(
            f"No replacement was performed, old_str `{old}` did not appear verbatim in {full}. "
            "Check whitespace and indentation (view the file first)."
        )
    if count > 1:
        lines, i = [], content.find(old)
        while i >= 0:
            lines.append(content.count("\n", 0, i) + 1)
            i = content.find(old, i + len(old))
        raise EditorError(
            f"No replacement was performed. Multiple occurrences of old_str `{old}` ({count} "
            f"matches) in lines {lines}. Please ensure it is unique (add surrounding lines)."
        )
    at = content.find(old)
    updated = content[:at] + new + content[at + len(old) :]
    _write_text(real, updated, create=False)
    line = content.count("\n", 0, at)
    return _edited(full, _snippet(updated, line, new.count("\n") + 1)), content


def insert(req: dict[str, Any], full: str, real: str) -> tuple[str, str | None]:
    n, new = req.get("insert_line"), req.get("new_str")
    if not isinstance(n, int) or isinstance(n, bool):
        raise EditorError("Parameter `insert_line` (an integer) is required for command: insert.")
    if not isinstance(new, str):
        raise EditorError("Parameter `new_str` is required for command: insert.")
    _require_file(full, real)
    content = _read_text(real, full, int(req["max_bytes"]))
    lines = _split_keep(content)
    if not 0 <= n <= len(lines):
        raise EditorError(
            f"Invalid `insert_line` parameter: {n}. It should be within the range of lines of "
            f"the file: [0, {len(lines)}] (0 inserts at the beginning)."
        )
    if n == len(lines) and lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    block = new if new.endswith("\n") else new + "\n"
    updated = "".join(lines[:n]) + block + "".join(lines[n:])
    _write_text(real, updated, create=False)
    return _edited(full, _snippet(updated, n, block.count("\n"))), content


def restore(req: dict[str, Any], full: str, real: str) -> tuple[str, str | None]:
    """undo_edit: put back the content the host kept (None: the edit created the file)."""
    b64 = req.get("content_b64")
    if b64 is None:
        if os.path.lexists(real) and not os.path.isdir(real):
            os.unlink(real)
        return f"Last edit to {full} undone successfully: the file it created was removed.", None
    if os.path.isdir(real):
        raise EditorError(f"Cannot undo: {full} is now a directory.")
    text = base64.b64decode(b64).decode("utf-8")
    exists = os.path.lexists(real)
    _write_text(real, text, create=not exists)
    lines = _display(text)
    header = f"Last edit to {full} undone successfully. Here's the result of running `cat -n` on {full}:\n"  # noqa: E501
    return _cap_lines(header, lines, 1, len(lines), int(req.get("max_chars", 16000))), None


def _require_file(full: str, real: str) -> None:
    if not os.path.lexists(full):
        raise EditorError(f"The path {full} does not exist. Please provide a valid path.")
    if not os.path.exists(real):
        raise EditorError(f"The path {full} is a dangling symlink.")


COMMANDS = {"create": create, "str_replace": str_replace, "insert": insert, "restore": restore}


def handle(req: dict[str, Any]) -> dict[str, Any]:
    root = req["root"]
    cmd = req.get("command")
    full = req.get("path", "")
    try:
        full = normalize(root, full)
        real = _real(full, root)
        if cmd == "view":
            return {"ok": True, "text": view(req, full, real), "path": full}
        if cmd not in COMMANDS:
            raise EditorError(f"Unknown command {cmd!r}.")
        existed = os.path.lexists(full)
        text, old = COMMANDS[cmd](req, full, real)
        old_b64 = None if old is None else base64.b64encode(old.encode("utf-8")).decode()
        return {"ok": True, "text": text, "path": full, "existed": existed, "old_b64": old_b64}
    except EditorError as e:
        return {"ok": False, "text": str(e), "path": full}
    except UnicodeEncodeError:
        return {
            "ok": False,
            "text": "The text contains invalid characters (lone surrogates).",
            "path": full,
        }
    except OSError as e:
        return {"ok": False, "text": f"{cmd} failed on {full}: {e.strerror or e}", "path": full}


def main() -> None:
    try:
        req = json.loads(sys.stdin.buffer.read().decode("utf-8"))
        res = handle(req)
    except Exception as e:  # a bug here: still one well-formed reply
        res = {"ok": False, "text": f"internal error: {type(e).__name__}: {e}", "path": ""}
    sys.stdout.write(RESULT_MARK + json.dumps(res, ensure_ascii=True))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
