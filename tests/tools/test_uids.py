"""Agent uids leased per run (tools/sandbox/uids.py): concurrent leases never overlap, a
killed holder's block is free again, leftovers of a dead run are killed at lease time, and two
real concurrent batches never share a uid nor touch each other's commands. Starts processes
as agent uids: run under the sandbox lock."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_jsonl
from tools.sandbox import AGENT_UID_BASE, UidsExhausted, lease_uids
from tools.sandbox.uids import BLOCK_SIZE


@pytest.fixture
def registry(needs_bwrap):
    d = Path(tempfile.mkdtemp(prefix="uid-registry-", dir="/tmp"))
    d.chmod(0o755)
    yield d / "uids"
    subprocess.run(["rm", "-rf", str(d)], check=True)


HOLD = """
import sys, time
from pathlib import Path
from tools.sandbox import lease_uids
lease = lease_uids(int(sys.argv[2]), Path(sys.argv[1]))
print(",".join(map(str, lease.blocks)), flush=True)
time.sleep(600)
"""


def hold(registry: Path, n: int) -> tuple[subprocess.Popen[str], list[int]]:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(registry), str(n)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    return p, [int(b) for b in p.stdout.readline().split(",")]


def test_leases_never_overlap_and_a_killed_holder_frees_its_blocks(registry):
    a, blocks_a = hold(registry, BLOCK_SIZE + 1)  # two blocks
    b, blocks_b = hold(registry, 1)
    try:
        assert len(blocks_a) == 2 and len(blocks_b) == 1
        assert not set(blocks_a) & set(blocks_b)
        mine = lease_uids(10, registry)
        assert not set(mine.blocks) & (set(blocks_a) | set(blocks_b))
        assert mine.uid(0) == AGENT_UID_BASE + mine.blocks[0] * BLOCK_SIZE
        with pytest.raises(IndexError):
            mine.uid(BLOCK_SIZE)
        mine.close()
        a.send_signal(signal.SIGKILL)  # no cleanup at all: the kernel drops the flock
        a.wait()
        again = lease_uids(2 * BLOCK_SIZE, registry)
        assert set(again.blocks) == set(blocks_a)  # the lowest free blocks: a's
        again.close()
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_exhausted_registry_says_so(registry, monkeypatch):
    monkeypatch.setattr("tools.sandbox.uids.MAX_BLOCKS", 1)
    held = lease_uids(1, registry)
    try:
        with pytest.raises(UidsExhausted, match="only 0 of the 1 uid blocks"):
            lease_uids(1, registry)
    finally:
        held.close()


def test_leftover_processes_of_a_dead_run_are_killed_at_lease(registry):
    uid = AGENT_UID_BASE  # block 0 of a fresh registry
    left = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "600"]
    )
    try:
        time.sleep(0.2)
        lease = lease_uids(1, registry)
        assert lease.blocks == [0]
        assert left.wait(timeout=10) == -signal.SIGKILL
        lease.close()
    finally:
        left.kill()


def step_command(mark: str, seconds: float) -> str:
    # The uid, then a sleep, then "survived": a sweep of the other batch would kill it
    return f"id -u; sleep {seconds}; echo survived-{mark}"


def start_batch(tmp: Path, name: str, seconds: float, n: int) -> subprocess.Popen[str]:
    tasks = tmp / f"{name}.jsonl"
    with tasks.open("w") as f:
        for i in range(n):
            call = {"name": "bash", "arguments": {"command": step_command(name, seconds)}}
            replay = [f"<tool_call>{json.dumps(call)}</tool_call>"] * 2
            f.write(json.dumps({"id": f"{name}-{i}", "prompt": "p", "replay": replay}) + "\n")
    args = [sys.executable, str(ROOT / "run.py"), "--tasks", str(tasks), "--out", str(tmp / name)]
    args += ["--engine", "replay", "--policy", "none", "--sandbox", "none", "--n-ctx", "100000"]
    return subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def uids_and_survivals(out: Path, name: str) -> tuple[set[int], int]:
    uids: set[int] = set()
    survived = 0
    for rec in read_jsonl(out / "trajectories.jsonl"):
        for step in rec["step_log"]:
            obs = step["observation"]
            if not obs.split()[0].isdigit():  # the closing submit
                continue
            uids.add(int(obs.split()[0]))
            survived += f"survived-{name}" in obs
    return uids, survived


def test_two_concurrent_batches_share_no_uid_and_touch_no_other_command(needs_bwrap):
    tmp = Path(tempfile.mkdtemp(prefix="two-batches-", dir="/tmp"))
    tmp.chmod(0o755)
    try:
        # slow: long commands; quick: short commands, each followed by a uid sweep (mode none)
        slow = start_batch(tmp, "slow", 4, 4)
        time.sleep(1.5)
        quick = start_batch(tmp, "quick", 0.1, 4)
        for p in (slow, quick):
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        slow_uids, slow_ok = uids_and_survivals(tmp / "slow", "slow")
        quick_uids, quick_ok = uids_and_survivals(tmp / "quick", "quick")
        assert len(slow_uids) == 4 and len(quick_uids) == 4
        assert not slow_uids & quick_uids
        assert slow_ok == 8 and quick_ok == 8  # every command of both ran to its end
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
