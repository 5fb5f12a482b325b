"""Task loading: every file type, per-record errors with file and line, ids, limits, offline hub."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runner.tasks.tasks import (
    SHIPPED,
    RecordError,
    Task,
    TaskSourceError,
    load_tasks,
    resolve_source,
)

ROOT = Path(__file__).resolve().parents[2]

# Valid records covering every field; the same set is written in each file format.
GOOD: list[dict] = [
    {
        "id": "t-prompt",
        "prompt": "Fix the bug.",
        "max_steps": 7,
        "files": {"a.py": "x = 1\n", "tests/test_a.py": "def test(): pass\n"},
        "setup": "pip --version",
        "eval": "python -m pytest -q",
        "metadata": {"difficulty": "easy", "ref": {"path": "a.py", "old": "1", "new": "2"}},
    },
    {
        "id": "t-messages",
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "now fix it"},
        ],
        "setup": ["echo one", "echo two"],
        "files": {"b.txt": "bee"},
        "metadata": {"difficulty": "medium"},
    },
    {"id": "t-minimal", "prompt": "Just do it."},
]


def check_good(tasks: list[Task]) -> None:
    """The tasks GOOD describes, whatever file type they came from."""
    assert [t.id for t in tasks] == ["t-prompt", "t-messages", "t-minimal"]
    a, b, c = tasks
    assert a.messages == [{"role": "user", "content": "Fix the bug."}]
    assert a.max_steps == 7 and type(a.max_steps) is int
    assert a.files == {"a.py": "x = 1\n", "tests/test_a.py": "def test(): pass\n"}
    assert a.setup == ["pip --version"]
    assert a.eval == "python -m pytest -q"
    assert a.metadata == {"difficulty": "easy", "ref": {"path": "a.py", "old": "1", "new": "2"}}
    assert b.messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "now fix it"},
    ]
    assert b.setup == ["echo one", "echo two"]
    assert b.files == {"b.txt": "bee"}
    assert b.metadata == {"difficulty": "medium"}
    assert b.max_steps is None and b.eval is None
    assert c.messages == [{"role": "user", "content": "Just do it."}]
    assert (c.max_steps, c.files, c.setup, c.eval, c.metadata, c.tools) == (
        None,
        {},
        [],
        None,
        {},
        None,
    )


def write_jsonl(path: Path, lines: list) -> Path:
    """`lines`: records (dumped as JSON) or raw strings (written as they are)."""
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path, monkeypatch):
    """Relative specs resolve against an empty directory, never the repo root."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)


# ---------------------------------------------------------------- valid JSONL


def test_valid_jsonl_loads_every_field(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", GOOD)
    tasks, errors, source = load_tasks(str(path))
    assert errors == []
    assert source == str(path)
    check_good(tasks)
    assert tasks[0].raw["id"] == "t-prompt"


def test_tools_field_and_numeric_id(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"id": 42, "prompt": "p", "tools": ["bash", "submit"], "max_steps": 3.0}],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert errors == []
    assert tasks[0].id == "42"
    assert tasks[0].tools == ["bash", "submit"]
    assert tasks[0].max_steps == 3 and type(tasks[0].max_steps) is int


def test_text_fields_that_look_like_json_stay_text(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"id": "j", "prompt": '{"question": 1}', "system": "[x]", "eval": "[ -f done ]"}],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert errors == []
    assert tasks[0].messages == [
        {"role": "system", "content": "[x]"},
        {"role": "user", "content": '{"question": 1}'},
    ]
    assert tasks[0].eval == "[ -f done ]"


# ---------------------------------------------------------------- invalid records

# (record or raw line, word the reason must mention)
BAD_EXTRA: list[tuple[object, str]] = [
    ({"id": "nul", "prompt": "x", "eval": "echo a\u0000b"}, "NUL"),
    ({"id": "tl", "prompt": "x", "tools": ["bash", "teleport"]}, "unknown tools"),
    ({"id": 7.5, "prompt": "x"}, "string or an integer"),
]
BAD: list[tuple[object, str]] = [
    ('{"id": "broken", "prompt": ', "JSON"),
    ({"prompt": "no id"}, "id"),
    ({"id": "", "prompt": "empty id"}, "id"),
    ({"id": "   ", "prompt": "blank id"}, "id"),
    ({"id": "a/b", "prompt": "slash"}, "id"),
    ({"id": "both", "prompt": "p", "messages": [{"role": "user", "content": "m"}]}, "prompt"),
    ({"id": "neither"}, "messages"),
    ({"id": "steps0", "prompt": "p", "max_steps": 0}, "max_steps"),
    ({"id": "stepsx", "prompt": "p", "max_steps": "x"}, "max_steps"),
    ({"id": "steps15", "prompt": "p", "max_steps": 1.5}, "max_steps"),
    ({"id": "stepsbool", "prompt": "p", "max_steps": True}, "max_steps"),
    ({"id": "abs", "prompt": "p", "files": {"/etc/passwd": "x"}}, "files"),
    ({"id": "dotdot", "prompt": "p", "files": {"../escape.py": "x"}}, "files"),
    ({"id": "dotdot2", "prompt": "p", "files": {"a/../../b": "x"}}, "files"),
    ({"id": "filesval", "prompt": "p", "files": {"a.py": 3}}, "files"),
    (
        {
            "id": "endsasst",
            "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        },
        "user",
    ),
    ({"id": "role", "messages": [{"role": "wizard", "content": "w"}]}, "role"),
    ({"id": "msgshape", "messages": [{"role": "user"}]}, "messages[0]"),
    ({"id": "emptymsgs", "messages": []}, "messages"),
    ({"id": "emptyprompt", "prompt": "   "}, "prompt"),
    ("[1, 2]", "object"),
    ("null", "object"),
    ('"just a string"', "object"),
    ({"id": "sysnum", "prompt": "p", "system": 5}, "system"),
    ({"id": "setupnum", "prompt": "p", "setup": [1]}, "setup"),
    ({"id": "evalnum", "prompt": "p", "eval": 5}, "eval"),
    ({"id": "metalist", "prompt": "p", "metadata": [1]}, "metadata"),
    ({"id": "toolsstr", "prompt": "p", "tools": "bash"}, "tools"),
    (
        {
            "id": "twosys",
            "system": "s",
            "messages": [{"role": "system", "content": "s2"}, {"role": "user", "content": "u"}],
        },
        "system",
    ),
]


def test_each_invalid_record_is_reported_with_file_line_and_field(tmp_path):
    # Layout: good, blank, bad, good-ish separator, bad, ... so line numbers are not dense.
    lines: list = [{"id": "first", "prompt": "ok"}, ""]
    expect: dict[int, str] = {}
    for i, (rec, word) in enumerate(BAD + BAD_EXTRA):
        lines.append(rec)
        expect[len(lines)] = word
        lines.append({"id": f"ok-{i}", "prompt": "fine"})
        if i % 3 == 0:
            lines.append("   ")  # whitespace-only: skipped like an empty line
    lines.append({"id": "last", "prompt": "ok"})
    path = write_jsonl(tmp_path / "mixed.jsonl", lines)

    tasks, errors, _ = load_tasks(str(path))

    n = len(BAD + BAD_EXTRA)
    assert [t.id for t in tasks] == ["first"] + [f"ok-{i}" for i in range(n)] + ["last"]
    assert all(isinstance(e, RecordError) for e in errors)
    assert {e.line: e.reason for e in errors}.keys() == expect.keys(), errors
    for e in errors:
        assert e.source == str(path)
        assert expect[e.line].lower() in e.reason.lower(), (e.line, e.reason)
        # The line number is the physical line: the record written there.
        raw = path.read_text().splitlines()[e.line - 1]
        assert raw.strip(), e
        j = e.to_json()
        assert (j["kind"], j["file"], j["line"], j["reason"]) == (
            "task",
            str(path),
            e.line,
            e.reason,
        )


def test_bad_json_line_number_and_task_id(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        ["", "", {"id": "a", "prompt": "p"}, "{not json}", "", {"id": "b/c", "prompt": "p"}],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["a"]
    assert [(e.line, e.task_id) for e in errors] == [(4, None), (6, "b/c")]
    assert "invalid JSON" in errors[0].reason
    assert '"id"' in errors[1].reason


def test_duplicate_id_names_the_first_line(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"id": "x", "prompt": "first"},
            "",
            {"id": "y", "prompt": "other"},
            {"id": "x", "prompt": "second"},
            {"id": "x", "prompt": "third"},
        ],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert [(t.id, t.messages[-1]["content"]) for t in tasks] == [("x", "first"), ("y", "other")]
    assert [(e.line, e.task_id) for e in errors] == [(4, "x"), (5, "x")]
    for e in errors:
        assert "duplicate" in e.reason and "line 1" in e.reason


def test_invalid_first_record_does_not_block_its_id(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [{"id": "x", "prompt": "p", "max_steps": 0}, {"id": "x", "prompt": "p", "max_steps": 2}],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert [(t.id, t.max_steps) for t in tasks] == [("x", 2)]
    assert [(e.line, e.task_id) for e in errors] == [(1, "x")]


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert load_tasks(str(path)) == ([], [], str(path))


# ---------------------------------------------------------------- file types


def test_json_array_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD))
    tasks, errors, _ = load_tasks(str(path))
    assert errors == []
    check_good(tasks)


def test_json_array_reports_record_numbers(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([GOOD[2], {"id": "bad", "prompt": "p", "max_steps": 0}]))
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["t-minimal"]
    assert [(e.source, e.line, e.task_id) for e in errors] == [(str(path), 2, "bad")]
    assert "max_steps" in errors[0].reason


def _as_json_strings(recs: list[dict]) -> list[dict]:
    """Nested fields as JSON text, the way CSV (and some Parquet files) store them."""
    return [
        {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in r.items()} for r in recs
    ]


def test_parquet_nested_fields_as_json_strings(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "t.parquet"
    pd.DataFrame(_as_json_strings(GOOD)).to_parquet(path, index=False)
    tasks, errors, _ = load_tasks(str(path))
    assert errors == []
    check_good(tasks)


def test_parquet_nested_fields_as_structs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    setup_as_lists = [
        {**r, "setup": [r["setup"]] if isinstance(r.get("setup"), str) else r.get("setup")}
        for r in GOOD
    ]
    # One schema for all rows: `files` / `metadata` become structs with the union of keys.
    table = pa.Table.from_pylist(setup_as_lists, schema=_infer_schema(pa, setup_as_lists))
    assert pa.types.is_struct(table.schema.field("files").type)
    assert pa.types.is_struct(table.schema.field("metadata").type)
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    tasks, errors, _ = load_tasks(str(path))
    assert errors == []
    check_good(tasks)


def _infer_schema(pa, recs: list[dict]):
    """A schema over all rows (from_pylist alone would look at the first row only)."""
    keys: list[str] = []
    for r in recs:
        keys += [k for k in r if k not in keys]
    full = [{k: r.get(k) for k in keys} for r in recs]
    return pa.Table.from_pydict({k: [r[k] for r in full] for k in keys}).schema


def test_parquet_bad_record_is_reported(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "t.parquet"
    recs = [{"id": "ok", "prompt": "p"}, {"id": "../x", "prompt": "p"}]
    pd.DataFrame(recs).to_parquet(path, index=False)
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["ok"]
    assert [(e.line, e.task_id) for e in errors] == [(2, "../x")]


def test_csv_nested_fields_as_json_strings(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "t.csv"
    # pandas writes max_steps as 7.0 (the column has gaps): it must come back as int 7.
    pd.DataFrame(_as_json_strings(GOOD)).to_csv(path, index=False)
    assert "7.0" in path.read_text()
    tasks, errors, _ = load_tasks(str(path))
    assert errors == []
    check_good(tasks)


def test_csv_keeps_text_as_text_and_reports_bad_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "id,prompt,max_steps,eval,files\n"
        '007,42,5,true,"{""a.py"": ""1""}"\n'
        "bad-steps,p,x,,\n"
        "frac,p,1.5,,\n"
        'multi,"line one\nline two",12,,\n'
        "missing-prompt,,3,,\n"
    )
    tasks, errors, _ = load_tasks(str(path))
    assert [(t.id, t.messages[-1]["content"], t.max_steps, t.eval) for t in tasks] == [
        ("007", "42", 5, "true"),
        ("multi", "line one\nline two", 12, None),
    ]
    assert tasks[0].files == {"a.py": "1"}
    assert [(e.line, e.task_id) for e in errors] == [  # file lines (multi spans 5-6)
        (3, "bad-steps"),
        (4, "frac"),
        (7, "missing-prompt"),
    ]
    assert all("max_steps" in e.reason for e in errors[:2])
    assert "prompt" in errors[2].reason


def test_all_file_types_load_the_same_tasks(tmp_path):
    pd = pytest.importorskip("pandas")
    write_jsonl(tmp_path / "s.jsonl", GOOD)
    (tmp_path / "s.json").write_text(json.dumps(GOOD))
    pd.DataFrame(_as_json_strings(GOOD)).to_parquet(tmp_path / "s.parquet", index=False)
    pd.DataFrame(_as_json_strings(GOOD)).to_csv(tmp_path / "s.csv", index=False)

    def key(t: Task):
        return (t.id, t.messages, t.max_steps, t.files, t.setup, t.eval, t.metadata, t.tools)

    loaded = {}
    for suffix in ("jsonl", "json", "parquet", "csv"):
        tasks, errors, _ = load_tasks(str(tmp_path / f"s.{suffix}"))
        assert errors == [], suffix
        loaded[suffix] = [key(t) for t in tasks]
    assert loaded["json"] == loaded["jsonl"]
    assert loaded["parquet"] == loaded["jsonl"]
    assert loaded["csv"] == loaded["jsonl"]


def test_suffix_is_case_insensitive(tmp_path):
    path = write_jsonl(tmp_path / "UPPER.JSONL", [GOOD[2], "{bad"])
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["t-minimal"]
    assert [e.line for e in errors] == [2]


# ---------------------------------------------------------------- limit / task ids


@pytest.fixture
def ten(tmp_path) -> Path:
    return write_jsonl(tmp_path / "ten.jsonl", [{"id": f"t{i}", "prompt": "p"} for i in range(10)])


def test_limit(ten):
    assert [t.id for t in load_tasks(str(ten), limit=3)[0]] == ["t0", "t1", "t2"]
    assert load_tasks(str(ten), limit=0)[0] == []
    assert len(load_tasks(str(ten), limit=100)[0]) == 10
    assert len(load_tasks(str(ten), limit=None)[0]) == 10


def test_task_ids_keep_dataset_order(ten):
    tasks, errors, _ = load_tasks(str(ten), task_ids=["t7", "t2", "t5"])
    assert [t.id for t in tasks] == ["t2", "t5", "t7"]
    assert errors == []


def test_task_ids_then_limit(ten):
    tasks, _, _ = load_tasks(str(ten), limit=2, task_ids=["t9", "t1", "t4"])
    assert [t.id for t in tasks] == ["t1", "t4"]


def test_unknown_task_ids_are_an_error(ten):
    tasks, errors, _ = load_tasks(str(ten), task_ids=["t3", "nope", "also-nope"])
    assert [t.id for t in tasks] == ["t3"]
    assert len(errors) == 1
    assert "nope" in errors[0].reason and "also-nope" in errors[0].reason
    assert errors[0].source == str(ten)


def test_empty_task_ids_mean_all(ten):
    assert len(load_tasks(str(ten), task_ids=[])[0]) == 10


# ---------------------------------------------------------------- source resolution


def test_missing_bare_file_name():
    with pytest.raises(TaskSourceError, match="not found") as ei:
        load_tasks("tasks_file_missing.jsonl")
    assert "tasks_file_missing.jsonl" in str(ei.value)


@pytest.mark.parametrize("spec", ["./missing.csv", "/nonexistent/dir/t.parquet", "gone.json"])
def test_missing_local_paths(spec):
    with pytest.raises(TaskSourceError, match="not found"):
        resolve_source(spec)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "tasks.txt"
    path.write_text('{"id": "a", "prompt": "p"}\n')
    with pytest.raises(TaskSourceError, match="unsupported") as ei:
        load_tasks(str(path))
    assert ".txt" in str(ei.value)


def test_relative_path_from_cwd(tmp_path):
    write_jsonl(Path.cwd() / "here.jsonl", [GOOD[2]])
    kind, location = resolve_source("here.jsonl")
    assert kind == "json" and Path(location).resolve() == (Path.cwd() / "here.jsonl").resolve()
    assert [t.id for t in load_tasks("here.jsonl")[0]] == ["t-minimal"]


def test_hub_names_resolve_to_hub():
    assert resolve_source("someuser/some-dataset") == ("hub", "someuser/some-dataset")
    assert resolve_source("squad") == ("hub", "squad")


def test_shipped_lookup():
    assert resolve_source("swe.jsonl") == ("json", str(SHIPPED / "swe.jsonl"))
    tasks, errors, source = load_tasks("swe.jsonl")
    assert errors == []
    assert Path(source) == ROOT / "tasks" / "swe.jsonl"
    assert len(tasks) == 10
    assert len({t.id for t in tasks}) == 10
    for t in tasks:
        assert t.files and t.eval
        assert t.messages[-1]["role"] == "user"
        assert t.max_steps is not None and 10 <= t.max_steps <= 16


# ---------------------------------------------------------------- Hugging Face hub, offline

HUB_NAME = "someuser/some-dataset-that-does-not-exist"


def _no_network(*_a, **_k):
    raise OSError("network disabled in tests")


def test_hub_offline_raises_task_source_error(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants as hub_constants

    hf_home = tmp_path / "hf"
    for var, val in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(hf_home),
    }.items():
        monkeypatch.setenv(var, val)
    # `datasets` (maybe imported by an earlier test) read the environment at import: patch
    # what it computed from it, too. monkeypatch restores all of it afterwards.
    for mod, names in (
        (datasets.config, ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
        (hub_constants, ("HF_HUB_OFFLINE",)),
    ):
        for n in names:
            if hasattr(mod, n):
                monkeypatch.setattr(mod, n, True)
    for mod, n, sub in (
        (datasets.config, "HF_CACHE_HOME", ""),
        (datasets.config, "HF_DATASETS_CACHE", "datasets"),
        (datasets.config, "HF_MODULES_CACHE", "modules"),
        (hub_constants, "HF_HOME", ""),
        (hub_constants, "HF_HUB_CACHE", "hub"),
        (hub_constants, "HUGGINGFACE_HUB_CACHE", "hub"),
    ):
        if hasattr(mod, n):
            monkeypatch.setattr(mod, n, str(hf_home / sub) if sub else str(hf_home))
    # Belt and braces: should anything still try the network, fail at once instead of hanging.
    monkeypatch.setattr(socket, "getaddrinfo", _no_network)
    monkeypatch.setattr(socket.socket, "connect", _no_network)

    with pytest.raises(TaskSourceError) as ei:
        load_tasks(HUB_NAME)
    msg = str(ei.value)
    assert HUB_NAME in msg
    assert "network" in msg and "local" in msg


def test_hub_offline_fresh_process(tmp_path):
    """The variables set before `import datasets` (the CLI's case) are honoured too."""
    code = textwrap.dedent(f"""
        import socket, sys
        def no_network(*a, **k):
            raise OSError("network disabled in tests")
        socket.getaddrinfo = no_network
        socket.socket.connect = no_network
        from runner.tasks.tasks import TaskSourceError, load_tasks
        try:
            load_tasks({HUB_NAME!r})
        except TaskSourceError as e:
            print("TaskSourceError:", e)
            sys.exit(0)
        except BaseException as e:
            print("WRONG", type(e).__name__, e)
            sys.exit(2)
        print("WRONG: loaded")
        sys.exit(3)
    """)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(ROOT),
    }
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert HUB_NAME in p.stdout and "network" in p.stdout


def test_unknown_fields_are_named_once(tmp_path):
    path = write_jsonl(
        tmp_path / "u.jsonl",
        [
            {"id": "a", "prompt": "x", "evall": "false"},
            {"id": "b", "prompt": "x", "evall": "false", "repo": "r"},
        ],
    )
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["a", "b"]  # extra columns are common: kept, not fatal
    (note,) = errors
    assert note.line == 0 and "'evall' (2 records)" in note.reason and "'repo'" in note.reason
