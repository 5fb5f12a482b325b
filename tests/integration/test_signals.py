"""SIGTERM and SIGINT to a real `run.py` subprocess (`--engine replay`, real bwrap sandbox):
the batch drains (admitted agents may finish within --grace-seconds, the rest are not
recorded), tool processes are killed, workspaces removed, summary.json says interrupted, the
exit code is 128+N; a second signal stops at once. Needs the sandbox lock (fixed agent uids)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.cli.main import workspace_root
from tests.conftest import ROOT, read_jsonl


def bash(cmd: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': cmd}})}</tool_call>"


def write_tasks(
    path: Path, short: int, long_sleep: float, long: int, short_sleep: float = 2
) -> tuple[Path, str]:
    """`short` agents whose one bash step sleeps `short_sleep`; `long` agents sleeping
    `long_sleep`.
    -> (the file, a mark unique to this test in every command line, to find its processes)."""
    mark = f"concur-test-{os.getpid()}-{path.parent.name}"
    with path.open("w") as f:
        for i in range(short):
            cmd = f"sleep {short_sleep}; : short {mark}"  # not the last command: bash stays
            f.write(json.dumps({"id": f"short-{i}", "prompt": "p", "replay": [bash(cmd)]}))
            f.write("\n")
        for i in range(long):
            cmd = f"sleep {long_sleep}; : long {mark}"
            f.write(json.dumps({"id": f"long-{i}", "prompt": "p", "replay": [bash(cmd)]}) + "\n")
    return path, mark


def start(tasks: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, str(ROOT / "run.py"), "--tasks", str(tasks), "--out", str(out)]
    args += ["--engine", "replay", "--n-ctx", "100000", "--tool-timeout", "300", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def wait_for_sleepers(n: int, mark: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until n sandboxed commands with `mark` are running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        if len(sleepers(mark)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} tool commands did not start within {timeout}s")


def sleepers(mark: str) -> list[int]:
    """The bash processes (inside the sandboxes) whose command line has `mark`."""
    out = subprocess.run(
        ["pgrep", "-f", f"^/usr/bin/bash -c .*{mark}"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def test_sigterm_drains_admitted_agents_and_exits_143(tmp_path, needs_bwrap):
    # The short ones must still be running when the signal comes (else the waiting task
    # takes a freed slot before it): 6 s leaves room for a loaded machine between the four
    # sleepers showing up and the signal; they finish well inside the 15 s grace.
    tasks, mark = write_tasks(tmp_path / "t.jsonl", short=2, long_sleep=600, long=2, short_sleep=6)
    out = tmp_path / "out"
    # Window 4: all four admitted; a fifth task waits at the gate and must not be admitted.
    with tasks.open("a") as f:
        f.write(json.dumps({"id": "waiting", "prompt": "p", "replay": [bash("true")]}) + "\n")
    proc = start(tasks, out, "--policy", "agent-cap:4", "--grace-seconds", "15")
    wait_for_sleepers(4, mark, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    took = time.monotonic() - t0
    assert proc.returncode == 143, err
    # the short ones finished within the grace period; the long ones were stopped at its end
    done = {r["task_id"]: r["status"] for r in read_jsonl(out / "trajectories.jsonl")}
    assert set(done) == {"short-0", "short-1"}, done
    assert 14 <= took < 50, took
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["stopped_by"] == "SIGTERM"
    assert "SIGTERM: stopping" in err and "stopped by SIGTERM" in err
    assert "Traceback" not in err
    assert not sleepers(mark), "a tool process outlived the runner"
    assert not workspace_root(out).exists()
    assert not list(out.glob("*.tmp"))


def test_second_signal_stops_at_once_and_resume_finishes(tmp_path, needs_bwrap):
    tasks, mark = write_tasks(tmp_path / "t.jsonl", short=0, long_sleep=600, long=2)
    out = tmp_path / "out"
    proc = start(tasks, out, "--policy", "none", "--grace-seconds", "300")
    wait_for_sleepers(2, mark, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err  # the first signal names the exit code
    assert time.monotonic() - t0 < 20  # not the 300 s grace period
    assert "SIGINT again: stopping now" in err and "Traceback" not in err
    assert not (out / "trajectories.jsonl").exists()
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True
    assert not sleepers(mark) and not workspace_root(out).exists()


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_grace_zero_stops_at_once(tmp_path, needs_bwrap, sig, code):
    tasks, mark = write_tasks(tmp_path / "t.jsonl", short=0, long_sleep=600, long=1)
    out = tmp_path / "out"
    proc = start(tasks, out, "--grace-seconds", "0")
    wait_for_sleepers(1, mark, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == sig.name
    assert not sleepers(mark) and not workspace_root(out).exists()
