"""Option values and datasets checked before anything runs: one clear line naming the option
(or the record and its line), exit 2, no run folder made; ids that cannot be file names;
bytes that are not UTF-8; empty and all-invalid datasets; one dataset however its path is
typed; load errors written once across reruns."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from runner.cli.main import main
from runner.tasks.tasks import MAX_ID_BYTES, expand_samples, load_tasks
from tests.conftest import read_jsonl, run_cli


def one_task(path: Path, tid: str = "a") -> Path:
    path.write_text(json.dumps({"id": tid, "prompt": "p"}) + "\n")
    return path


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--eval-timeout", "0"], "--eval-timeout must be > 0"),
        (["--tool-timeout", "0"], "--tool-timeout must be > 0"),
        (["--tool-timeout", "-3"], "--tool-timeout must be > 0"),
        (["--tool-timeout", "nan"], "--tool-timeout must be > 0"),
        (["--progress-interval", "0"], "--progress-interval must be >= 0.5"),
        (["--grace-seconds", "-1"], "--grace-seconds must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--n-ctx", "0"], "--n-ctx must be >= 1"),
        (["--top-p", "0"], "--top-p must be > 0"),
        (["--top-p", "1.5"], "--top-p must be <= 1"),
        (["--temperature", "-0.1"], "--temperature must be >= 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--pool-tokens", "10"], "--pool-tokens must be >= 64"),
        (["--max-seqs", "0"], "--max-seqs must be >= 1"),
        (["--prefill-chunk", "8"], "--prefill-chunk must be >= 16"),
        (["--max-steps", "0"], "--max-steps must be >= 1"),
        (["--limit", "-1"], "--limit must be >= 0"),
        (["--control-period", "0"], "--control-period must be > 0"),
        (["--initial-window", "0"], "--initial-window must be >= 1"),
        (["--hicache-ratio", "-1"], "--hicache-ratio must be >= 0"),
        (["--tools", " , "], "--tools names no tool"),
        (["--tools", "bash,nope"], "--tools: unknown ['nope']"),
        (["--task-ids", ","], "--task-ids names no task id"),
    ],
)
def test_bad_option_values_are_one_clear_error(tmp_path, capsys, flags, message):
    tasks = one_task(tmp_path / "t.jsonl")
    out = tmp_path / "out"
    assert main(["--tasks", str(tasks), "--out", str(out), "--engine", "replay", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: ") and message in err, err
    assert "Traceback" not in err
    assert not out.exists()  # nothing made on the way to refusing


def test_out_naming_a_file_or_an_unwritable_place(tmp_path, capsys):
    tasks = one_task(tmp_path / "t.jsonl")
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main(["--tasks", str(tasks), "--out", str(a_file)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["--tasks", str(tasks), "--out", str(a_file / "sub")]) == 2
    assert f"{a_file} is not a directory" in capsys.readouterr().err
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    # root writes through any mode bits: for root, a real read-only mount is the case
    mounted = os.geteuid() == 0
    if mounted:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        assert main(["--tasks", str(tasks), "--out", str(ro / "out")]) == 2
        assert f"{ro} is not writable by this user" in capsys.readouterr().err
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        ro.chmod(0o700)


def test_ids_that_cannot_be_file_names_are_rejected_at_load(tmp_path):
    bad_ids = ["x" * (MAX_ID_BYTES + 1), "a/b", "a\\b", "tab\there", "nl\nx", ".", "..", " pad"]
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        for tid in [*bad_ids, "é" * (MAX_ID_BYTES // 2), "ok-1"]:
            f.write(json.dumps({"id": tid, "prompt": "p"}) + "\n")
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["é" * (MAX_ID_BYTES // 2), "ok-1"]
    assert [e.line for e in errors] == list(range(1, len(bad_ids) + 1))
    assert f"at most {MAX_ID_BYTES}" in errors[0].reason


def test_an_id_with_a_hash_is_refused_at_load_it_would_pose_as_a_sample(tmp_path):
    # `a#1` would be sample 1 of task `a` under --samples: same id, same report group
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": t, "prompt": "p"}) + "\n" for t in ["a", "a#1"]))
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["a"]
    assert [e.line for e in errors] == [2]
    assert 'contains "#", which is reserved for sample ids' in errors[0].reason
    assert [t.id for t in expand_samples(tasks, 2)] == ["a#0", "a#1"]


def test_bytes_that_are_not_utf8_are_reported_with_their_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"id": "good", "prompt": "p"}\n{"id": "caf\xe9", "prompt": "p"}\n')
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["good"]
    assert errors[0].line == 2 and "not UTF-8: byte 0xe9" in errors[0].reason
    csv_path = tmp_path / "t.csv"
    csv_path.write_bytes(b"id,prompt\ngood,p\nbad,caf\xe9\n")
    with pytest.raises(ValueError, match=r"t\.csv:3: not UTF-8 \(byte 0xe9\)"):
        load_tasks(str(csv_path))


def test_empty_or_all_invalid_dataset_exits_non_zero_with_the_counts(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["--tasks", str(empty), "--out", str(tmp_path / "o1")]) == 2
    assert "0 valid, 0 invalid records" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\nnot json\n')
    assert main(["--tasks", str(bad), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "0 valid, 2 invalid records" in err and "line 2: invalid JSON" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_one_dataset_however_typed_and_load_errors_written_once(tmp_path, needs_bwrap):
    data = tmp_path / "data"
    data.mkdir()
    tasks = data / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": "p"}) + "\n{broken\n")
    out = tmp_path / "out"
    common = ["--out", str(out), "--engine", "replay", "--policy", "none"]
    run_cli("--tasks", str(tasks), *common, cwd=tmp_path)
    run_cli("--tasks", "data/t.jsonl", *common, cwd=tmp_path)  # relative: the same dataset
    p = run_cli("--tasks", "./data/../data/t.jsonl", *common, cwd=tmp_path)
    assert "1 dataset problems, as reported before" in p.stderr
    task_errors = [e for e in read_jsonl(out / "errors.jsonl") if e["kind"] == "task"]
    assert len(task_errors) == 1 and task_errors[0]["line"] == 2
    meta = json.loads((out / "run.json").read_text())
    assert meta["source"] == str(tasks.resolve()) and len(meta["sha256"]) == 64
    # moved elsewhere, same content: the same dataset; another dataset: refused
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(tasks.read_bytes())
    run_cli("--tasks", str(moved), *common)
    other = one_task(tmp_path / "other.jsonl", "b")
    p = run_cli("--tasks", str(other), *common, check=False)
    assert p.returncode == 2 and "holds a run of" in p.stderr
