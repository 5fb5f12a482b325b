import json
import os
import shlex
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


def _hidden_dirs() -> dict[Path, set[Path]]:
    """Directories other users cannot enter -> their children that hold what another user's
    process needs here: this interpreter (pyenv under /root, mode 0700; in a venv, also the
    base interpreter its python links to) and the checkout (a clone under a mktemp folder,
    mode 0700)."""
    hidden: dict[Path, set[Path]] = {}
    for need in (Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), ROOT):
        for parent in reversed(need.parents):  # "/" first
            if not os.stat(parent).st_mode & 0o001:
                hidden.setdefault(parent, set()).add(parent / need.relative_to(parent).parts[0])
                break
    return hidden


def reachable_by_others(argv: list[str]) -> list[str]:
    """`argv` (which switches to another user) in a private mount namespace where each
    directory others cannot enter is an empty tmpfs with only the children it needs bound
    back: the interpreter and the checkout, nothing else of root's. As is where nothing is
    hidden."""
    hidden = _hidden_dirs()
    if not hidden:
        return argv
    steps = []
    for i, (top, keeps) in enumerate(sorted(hidden.items())):
        kept = [shlex.quote(str(k)) for k in sorted(keeps)]
        steps += [
            f'k{i}_{j}=$(mktemp -d) && mount --bind {k} "$k{i}_{j}"' for j, k in enumerate(kept)
        ]
        steps.append(f"mount -t tmpfs -o mode=0755,size=1m tmpfs {shlex.quote(str(top))}")
        steps += [
            f'mkdir -p {k} && mount --move "$k{i}_{j}" {k} && rmdir "$k{i}_{j}"'
            for j, k in enumerate(kept)
        ]
    script = " && ".join(steps) + ' && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]
