import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.sandbox import BwrapSandbox

ROOT = Path(__file__).resolve().parent.parent
SWE = ROOT / "tasks" / "swe.jsonl"


def small_tasks(path: Path, n: int, max_steps: int = 2) -> Path:
    """The first n shipped SWE tasks with a short step budget."""
    lines = SWE.read_text().splitlines()[:n]
    with path.open("w") as f:
        for line in lines:
            rec = json.loads(line)
            rec["max_steps"] = max_steps
            f.write(json.dumps(rec) + "\n")
    return path


def run_cli(
    *args: str, timeout: float = 600, check: bool = True, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    # PYTHONPATH: the worktree's code wins over the editable install wherever cwd is
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"run.py {' '.join(args)} exited {p.returncode}:\n{p.stderr[-4000:]}")
    return p


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """One JSON object per line (a task dataset, a trace, a run's records)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def needs_bwrap():
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.fail("these tests need root and bubblewrap (apt-get install -y bubblewrap)")


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    """A 0711 directory under /tmp for workspaces. Not pytest's tmp_path: /tmp/pytest-of-root
    is 0700, so the sandbox uids could not reach it."""
    d = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir="/tmp"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def sb() -> BwrapSandbox:
    return BwrapSandbox()
