"""The run folder: locking, resume bookkeeping, records that survive odd text."""

import json

import pytest

from runner.store import RunFolderBusy, RunStore


def test_one_writer_per_run_folder(tmp_path):
    a = RunStore(tmp_path / "run")
    with pytest.raises(RunFolderBusy, match="in use by another run"):
        RunStore(tmp_path / "run")
    del a  # the lock goes with its owner
    RunStore(tmp_path / "run")


def test_lone_surrogates_are_stored_not_fatal(tmp_path):
    s = RunStore(tmp_path / "run")
    s.add_trajectory({"task_id": "t", "status": "submitted", "answer": "x\ud800y"})
    rec = json.loads((tmp_path / "run" / "trajectories.jsonl").read_text())
    assert rec["answer"] == "x\ud800y"


def test_retry_errors_only_for_the_selected_tasks(tmp_path):
    s = RunStore(tmp_path / "run")
    s.add_trajectory({"task_id": "a", "status": "error", "reason": "boom"})
    s.add_trajectory({"task_id": "b", "status": "error", "reason": "boom"})
    s.add_trajectory({"task_id": "c", "status": "submitted"})
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
