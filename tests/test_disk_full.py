"""A run folder on a real, small tmpfs that fills up during the batch: the batch stops with one
clear error naming the file and the free space, exits non-zero, leaves no torn line and no
temp file, loses no record it reported written; after the filesystem grows, the rerun
resumes and finishes every task exactly once. Needs root (mount) and the sandbox lock."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from .conftest import run_cli

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
