"""Nothing outlives the runner: 20 SIGKILLs of a real `run.py` (real bwrap sandboxes, tool
commands starting and ending all the time) at random moments; after each, no process of the
run, no workspace and no workspace mount is left once its reaper is through; then a rerun
finishes every task exactly once and leaves nothing either. Needs the sandbox lock (agent uids)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from runner.cli.main import workspace_root
from tests.conftest import ROOT, read_jsonl, run_cli

KILLS = 20
N_TASKS = 10


def bash(cmd: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': cmd}})}</tool_call>"


def marked(mark: str) -> list[str]:
    """Every process whose command line has `mark` (the runner's sandboxes: bwrap, bash)."""
    out = subprocess.run(["pgrep", "-a", "-f", mark], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def mounts_under(ws: Path) -> list[str]:
    """The workspaces' own filesystems (tmpfs by default) still mounted, from /proc/mounts."""
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return [p for p in points if p == str(ws) or p.startswith(f"{ws}/")]


# 60 s, not 20: once, on a machine loaded by eight parallel test runs, a killed sandbox's bwrap
# was still exiting at 20 s (gone moments later); what outlives the runner stays for good.
def wait_until_clean(mark: str, ws: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not marked(mark) and not ws.exists() and not mounts_under(ws):
            return
        time.sleep(0.1)
    raise AssertionError(
        f"left behind: processes {marked(mark)}, workspaces {ws.exists()}, "
        f"mounts {mounts_under(ws)}"
    )


def test_twenty_sigkills_leave_nothing_behind(tmp_path, needs_bwrap):
    rng = random.Random(13)
    mark = f"killmark-{os.getpid()}"
    tasks = tmp_path / "t.jsonl"
    with tasks.open("w") as f:
        for i in range(N_TASKS):
            steps = [bash(f"sleep {rng.choice([0, 0.2, 0.6])}; : {mark}") for _ in range(3)]
            f.write(json.dumps({"id": f"k-{i}", "prompt": "p", "replay": steps}) + "\n")
    out = tmp_path / "out"
    args = [sys.executable, str(ROOT / "run.py"), "--tasks", str(tasks), "--out", str(out)]
    args += ["--engine", "replay", "--policy", "agent-cap:5", "--n-ctx", "100000", "-q"]
    ws = workspace_root(out)
    for _ in range(KILLS):
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.3, 3.0))  # start-up, setup, commands: all moments
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until_clean(mark, ws)
    run_cli(*args[2:])
    wait_until_clean(mark, ws)
    ids = [r["task_id"] for r in read_jsonl(out / "trajectories.jsonl")]
    assert sorted(ids) == sorted(f"k-{i}" for i in range(N_TASKS))  # each exactly once
    assert not list(Path("/sys/fs/cgroup/memory").glob("concur-*/u*")) or all(
        Path(f"/proc/{d.parent.name.removeprefix('concur-')}").exists()
        for d in Path("/sys/fs/cgroup/memory").glob("concur-*/u*")
    )  # no cgroup of a dead runner
