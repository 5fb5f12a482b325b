"""The run folder: locking, resume bookkeeping, records that survive odd text."""

import asyncio
import json

import pytest

from runner.runfolder.store import RunFolderBusy, RunStore


def test_one_writer_per_run_folder(tmp_path):
    a = RunStore(tmp_path / "run")
    with pytest.raises(RunFolderBusy, match="in use by another run"):
        RunStore(tmp_path / "run")
    del a  # the lock goes with its owner
    RunStore(tmp_path / "run")


def test_lone_surrogates_are_stored_not_fatal(tmp_path):
    s = RunStore(tmp_path / "run")
    s.add_trajectories([{"task_id": "t", "status": "submitted", "answer": "x\ud800y"}])
    rec = json.loads((tmp_path / "run" / "trajectories.jsonl").read_text())
    assert rec["answer"] == "x\ud800y"


def test_retry_errors_only_for_the_selected_tasks(tmp_path):
    s = RunStore(tmp_path / "run")
    s.add_trajectories([{"task_id": "a", "status": "error", "reason": "boom"}])
    s.add_trajectories([{"task_id": "b", "status": "error", "reason": "boom"}])
    s.add_trajectories([{"task_id": "c", "status": "submitted"}])
    assert s.retry_errors({"a", "c"}) == ["a"]
    lines = [
        json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    ]
    assert [r["task_id"] for r in lines] == ["b", "c"]  # b was not selected: kept
    assert set(s.finished) == {"b", "c"}
    errors = (tmp_path / "run" / "errors.jsonl").read_text()
    assert '"previous_attempt"' in errors and '"a"' in errors


def test_a_run_folder_belongs_to_one_dataset(tmp_path):
    s = RunStore(tmp_path / "run")
    s.bind_source("/data/a.jsonl")
    s.bind_source("/data/a.jsonl")  # resume: fine
    with pytest.raises(RunFolderBusy, match=r"holds a run of /data/a\.jsonl"):
        s.bind_source("/data/b.jsonl")


async def test_agents_finishing_together_share_fsyncs_and_keep_their_order(tmp_path, monkeypatch):
    """Off the loop, in groups: 200 agents finishing at once are all recorded, each line
    whole, each rollout written and synced before its trajectory line, with far fewer
    fsyncs than lines (the lines that wait for the writer thread go together)."""
    import os

    import runner.runfolder.store as store

    s = RunStore(tmp_path / "run")
    syncs, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd))[1])
    appends, real_append = [], store._append_lines  # (file, task ids) in the order written

    def append(path, lines, sync):
        real_append(path, lines, sync)
        appends.append((path.name, {json.loads(line)["task_id"] for line in lines}))

    monkeypatch.setattr(store, "_append_lines", append)
    await s.log_control({"t": 0, "task_id": None})

    async def agent(i: int) -> None:
        rec = {"task_id": f"t{i}", "status": "submitted"}
        await s.finish(rec, {"rollouts.jsonl": {"task_id": f"t{i}", "ids": list(range(50))}})

    await asyncio.gather(*(agent(i) for i in range(200)))
    trajs = [json.loads(x)["task_id"] for x in s.trajectories.read_text().splitlines()]
    rolls = [json.loads(x)["task_id"] for x in s.rollouts.read_text().splitlines()]
    assert sorted(trajs) == sorted(rolls) == sorted(f"t{i}" for i in range(200))
    assert set(s.finished) == set(trajs)
    when = {(name, tid): n for n, (name, ids) in enumerate(appends) for tid in ids}
    assert all(when["rollouts.jsonl", t] < when["trajectories.jsonl", t] for t in trajs)
    assert len(syncs) < 40  # for 400 lines


async def test_a_cancelled_writer_waits_for_its_line(tmp_path):
    """An agent cancelled while its record is being written (a signal's stop) returns only
    after the line is on disk, and the store knows it finished."""
    s = RunStore(tmp_path / "run")
    task = asyncio.create_task(s.finish({"task_id": "a", "status": "submitted"}, {}))
    await asyncio.sleep(0)  # the write has started
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert json.loads(s.trajectories.read_text())["task_id"] == "a" and "a" in s.finished
