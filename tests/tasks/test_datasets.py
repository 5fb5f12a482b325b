"""Other people's datasets: --field-map, save_to_disk folders, CSV lines, SWE-bench records
without a map. Pure Python (no sandbox): the CLI cases fail before any sandbox starts."""

from __future__ import annotations

import pytest

from runner.tasks.formats import FieldMapError, parse_field_map
from runner.tasks.tasks import KNOWN_FIELDS, TaskSourceError, load_tasks
from tests.conftest import run_cli, write_jsonl


def test_field_map_parses_and_names_bad_items():
    assert parse_field_map("id=instance_id, prompt = problem_statement", KNOWN_FIELDS) == {
        "id": "instance_id",
        "prompt": "problem_statement",
    }
    for text, words in [
        ("id", "TASK_FIELD=RECORD_FIELD"),
        ("id=", "TASK_FIELD=RECORD_FIELD"),
        ("idd=x", "'idd' is not a task field"),
        ("id=a,id=b", "mapped twice"),
    ]:
        with pytest.raises(FieldMapError, match=words):
            parse_field_map(text, KNOWN_FIELDS)


def test_field_map_reads_any_record_field_into_any_task_field(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"key": "t1", "question": "add 1 and 2", "check": "true", "budget": 3},
            {"key": "t2", "question": "q2", "check": "false", "budget": 4},
            {"key": "t3", "check": "true", "budget": 4},  # no question: its line is named
        ],
    )
    fmap = {"id": "key", "prompt": "question", "eval": "check", "max_steps": "budget"}
    tasks, errors, _ = load_tasks(str(path), field_map=fmap)
    assert [(t.id, t.messages[-1]["content"], t.eval, t.max_steps) for t in tasks] == [
        ("t1", "add 1 and 2", "true", 3),
        ("t2", "q2", "false", 4),
    ]
    (err,) = errors  # the mapped-from fields are not reported as unknown
    assert (err.line, err.task_id) == (3, None)
    assert err.reason == "--field-map prompt=question: the record has no field 'question'"


def test_a_field_no_record_has_stops_the_run_naming_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}])
    with pytest.raises(
        TaskSourceError, match=rf"{path}:1: --field-map prompt=question: .*'question'"
    ):
        load_tasks(str(path), field_map={"prompt": "question"})
    p = run_cli(
        "--tasks",
        str(path),
        "--field-map",
        "prompt=question",
        "--engine",
        "replay",
        "--out",
        str(tmp_path / "out"),
        check=False,
    )
    assert p.returncode != 0
    assert f"{path}:1: --field-map prompt=question: the record has no field 'question'" in p.stderr
    bad = run_cli("--tasks", str(path), "--field-map", "prompt", check=False)
    assert bad.returncode == 2 and "argument --field-map: bad item 'prompt'" in bad.stderr


def test_field_map_in_a_config_file_is_checked_too(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "x"}])
    cfg = tmp_path / "run.toml"
    cfg.write_text('field_map = "nope=x"\n')
    p = run_cli("--config", str(cfg), "--tasks", str(path), check=False)
    assert p.returncode == 2 and "key 'field_map': 'nope' is not a task field" in p.stderr


def test_swebench_records_map_their_fields_without_a_field_map(tmp_path):
    path = write_jsonl(
        tmp_path / "swe.jsonl",
        [
            {
                "instance_id": "o__r-1",
                "problem_statement": "It breaks.",
                "hints_text": "",
                "version": "1.0",
                "created_at": "2024",
            }
        ],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert [(t.id, t.messages[-1]["content"]) for t in tasks] == [("o__r-1", "It breaks.")]
    assert errors == []  # SWE-bench's other columns are not "unknown fields"


def test_swebench_records_none_valid_exit_nonzero_with_the_reason(tmp_path):
    """SWE-bench's own `repo` is a GitHub name: without a local mirror nothing can run."""
    path = write_jsonl(
        tmp_path / "swe.jsonl",
        [
            {
                "instance_id": f"o__r-{i}",
                "problem_statement": "p",
                "repo": "o/r",
                "base_commit": "a" * 40,
                "FAIL_TO_PASS": '["t::x"]',
            }
            for i in range(2)
        ],
    )
    with pytest.raises(TaskSourceError, match=r"swe.jsonl:1: \"repo\" 'o/r'.*git clone --mirror"):
        load_tasks(str(path))
    p = run_cli(
        "--tasks", str(path), "--engine", "replay", "--out", str(tmp_path / "o"), check=False
    )
    assert p.returncode != 0 and "need a local clone or mirror" in p.stderr


def test_save_to_disk_folders_load_as_datasets(tmp_path):
    import datasets

    rows = [{"id": "a", "prompt": "p1", "eval": "true"}, {"id": "b", "prompt": "p2", "eval": "x"}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "one"))
    tasks, errors, source = load_tasks(str(tmp_path / "one"))
    assert [(t.id, t.eval) for t in tasks] == [("a", "true"), ("b", "x")] and errors == []
    assert source == str(tmp_path / "one")
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "dd"))
    tasks, _, _ = load_tasks(str(tmp_path / "dd"), split="test")
    assert [t.id for t in tasks] == ["b"]
    with pytest.raises(TaskSourceError, match=r"no split 'dev'.*train, test"):
        load_tasks(str(tmp_path / "dd"), split="dev")
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskSourceError, match="not a dataset saved with `save_to_disk`"):
        load_tasks(str(tmp_path / "plain"))


def test_csv_row_with_extra_cells_is_named_by_its_file_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('id,prompt\na,"two\nlines"\nb,p,surplus\nc,p\n')
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["a", "c"]
    (err,) = errors
    assert (err.source, err.line) == (str(path), 4)
    assert err.reason == "1 more cells than the header's 2 columns"
