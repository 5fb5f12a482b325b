"""A run folder on a real, small tmpfs that fills up during the batch: the batch stops with one
clear error naming the file and the free space, exits non-zero, leaves no torn line and no
temp file, loses no record it reported written; after the filesystem grows, the rerun
resumes and finishes every task exactly once. Needs root (mount) and the sandbox lock."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runner.chat.toolcall import format_call
from tests.conftest import ROOT, read_jsonl, run_cli

N_TASKS = 30
PROMPT = "x" * 40_000  # each record holds its prompt: ~40 KB a line


@pytest.fixture
def small_fs(needs_bwrap):
    d = Path(tempfile.mkdtemp(prefix="full-disk-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", str(d)], check=True)
    d.rmdir()


def test_disk_full_stops_cleanly_and_the_rerun_resumes(tmp_path, small_fs):
    tasks = tmp_path / "t.jsonl"
    with tasks.open("w") as f:
        for i in range(N_TASKS):
            f.write(json.dumps({"id": f"d-{i:02d}", "prompt": PROMPT}) + "\n")
    out = small_fs / "out"
    args = ["--tasks", str(tasks), "--out", str(out), "--engine", "replay", "--n-ctx", "1000000"]
    args += ["--policy", "agent-cap:4"]
    p = run_cli(*args, check=False)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and "Logging error" not in p.stderr, p.stderr
    assert f"cannot write {out}/" in p.stderr and "MiB free on its filesystem" in p.stderr
    assert "free space and run the same command to resume" in p.stderr
    traj = out / "trajectories.jsonl"
    data = traj.read_bytes()
    assert data.endswith(b"\n")  # no torn line
    first = [json.loads(line)["task_id"] for line in data.splitlines()]
    assert 0 < len(first) < N_TASKS and len(first) == len(set(first))
    assert not [f for f in out.iterdir() if f.name.endswith(".tmp")]
    assert not list(out.glob("*.torn"))
    # more room: the rerun resumes where it stopped
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_fs)], check=True)
    p = run_cli(*args)
    ids = [json.loads(line)["task_id"] for line in traj.read_text().splitlines()]
    assert ids[: len(first)] == first  # the records written before are all there
    assert sorted(ids) == [f"d-{i:02d}" for i in range(N_TASKS)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == N_TASKS and summary["this_session"][
        "agents_run"
    ] == N_TASKS - len(first)


def fill(fs: Path) -> Path:
    """Take every free byte of `fs` with one file (a tmpfs: page by page). -> that file."""
    filler = fs / "filler"
    with filler.open("wb", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return filler


def test_a_control_line_that_cannot_be_written_stops_the_batch_once(tmp_path, small_fs):
    """The disk fills while every agent is busy, so the first write that fails is a control
    period's line: one error naming control.jsonl and the free space, a clean stop, exit 1
    (before: a traceback every period while the batch went on)."""
    tasks = tmp_path / "t.jsonl"
    sleep = format_call("bash", {"command": "sleep 4"})
    with tasks.open("w") as f:
        for i in range(2):
            f.write(json.dumps({"id": f"c-{i}", "prompt": "p", "replay": [sleep]}) + "\n")
    out = small_fs / "out"
    args = ["--tasks", str(tasks), "--out", str(out), "--engine", "replay", "--n-ctx", "100000"]
    args += ["--policy", "agent-cap:2", "--control-period", "0.05"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "run.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "control.jsonl").exists():  # the batch runs, its agents sleep
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.02)
    filler = fill(small_fs)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "Logging error" not in stderr, stderr
    assert stderr.count(f"cannot write {out}/control.jsonl") == 1, stderr
    assert "MiB free on its filesystem" in stderr
    assert "free space and run the same command to resume" in stderr
    assert not (out / "trajectories.jsonl").exists()  # no agent got to finish
    assert not [f for f in out.iterdir() if f.name.endswith(".tmp")]
    assert (out / "control.jsonl").read_bytes().endswith(b"\n")  # no torn line
    # space again: the rerun runs both agents to the end
    filler.unlink()
    run_cli(*args)
    ids = sorted(r["task_id"] for r in read_jsonl(out / "trajectories.jsonl"))
    assert ids == ["c-0", "c-1"]
