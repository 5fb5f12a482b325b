"""Another git ref's `runner` package, and the child processes that import it.

A side-by-side measurement (`python -m bench.gate_bench --baseline REF`, the same for
bench.gate_count) runs each side in a fresh process: `baseline_code` extracts the ref's
runner/ into a folder, and `child(code)` gives the subprocess arguments of a
`python -m bench.<script>` child whose `import runner` finds `code`'s package. Under -m the
working directory comes first on the import path, so the child runs in `code`; PYTHONPATH
puts `code`, then this checkout's root (for `bench` itself, and `tools`) ahead of the
installed packages. No process edits its import path at run time; the child checks where its
`runner` came from (`check_runner`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from bench.common.paths import ROOT

CODE_ENV = "GATE_BENCH_CODE"  # the folder a child must import `runner` from


def baseline_code(ref: str, into: Path) -> Path:
    """The `runner` package as it is at git `ref`, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "runner"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def child(code: Path) -> dict[str, Any]:
    """`subprocess.run` keyword arguments (cwd, env) for a `python -m bench.<script>` child
    that imports `runner` from `code` (this checkout's ROOT, or a `baseline_code` folder)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([str(code), str(ROOT), *inherited])
    return {"cwd": code, "env": {**os.environ, CODE_ENV: str(code), "PYTHONPATH": path}}


def check_runner() -> None:
    """In a child: exit unless `runner` was imported from the folder its parent named."""
    code = os.environ.get(CODE_ENV)
    if code is None:  # run by hand: whichever `runner` Python finds
        return
    import runner

    found = Path(runner.__file__).resolve().parent.parent
    if found != Path(code).resolve():
        raise SystemExit(f"runner imported from {found}, not from {CODE_ENV}={code}")
