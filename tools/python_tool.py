"""`python`: run a Python program with the sandbox's /usr/bin/python3 in the workspace.

The code travels on stdin into a temporary file in the sandbox's private /tmp and runs from
there, with the workspace as the current directory and first on sys.path (as `python3 -c`
would): tracebacks show the source lines, and the project's modules import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .core import (
    Observation,
    ToolContext,
    limits_with_timeout,
    result_observation,
    timed_parameters,
)

# sys.path[0] is "" (the cwd, i.e. the workspace) under -c; the program's own frames are
# named after the temp file, so tracebacks can print its lines.
_BOOT = (
    "import sys; p = sys.argv[1]; sys.argv = sys.argv[1:]; "
    "src = open(p, encoding='utf-8').read(); "
    "exec(compile(src, p, 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})"
)
COMMAND = (
    'f=$(mktemp "${TMPDIR:-/tmp}/snippet-XXXXXX.py") || exit 1; cat > "$f"; '
    f'/usr/bin/python3 -B -c "{_BOOT}" "$f"; rc=$?; rm -f "$f"; exit $rc'
)


@dataclass
class Python:
    name: str = "python"
    description: str = (
        "Run a Python 3 program (the sandbox's python3, standard library plus pytest; no "
        "network) in the task's workspace, the current directory, and return its output and "
        "exit code. Print what you want to see. The program reads no input."
    )
    parameters: dict[str, Any] = field(
        default_factory=lambda: timed_parameters(
            "code", "The Python source to run.", killed="the program"
        )
    )
    max_timeout: float = 600.0

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        limits = limits_with_timeout(self.name, args, ctx, self.max_timeout)
        if isinstance(limits, Observation):
            return limits
        code = args["code"]
        if not code.strip():
            return Observation("python: `code` is empty; give the program to run.", ok=False)
        try:
            code.encode("utf-8")
        except UnicodeEncodeError:
            return Observation("python: the code contains invalid characters.", ok=False)
        try:
            r = await ctx.sandbox.run(COMMAND, ctx.workspace, ctx.uid, limits, stdin=code)
        except OSError as e:
            return Observation(f"python: could not start: {e}", ok=False)
        return result_observation(r, limits)
