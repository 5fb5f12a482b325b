"""SWE-bench-style records on a local git repository, end to end: `run.py --engine replay`
with the real sandbox (run under the sandbox lock). The repository is built here: a bug at
the base commit, a later commit the workspace must not start at, a test patch adding the
failing test."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest

from runner.tasks.swebench import (
    DEFAULT_TEST_CMD,
    apply_script,
    checkout,
    parse_spec,
    patched_paths,
)
from runner.tasks.tasks import load_tasks
from tests.conftest import ROOT, read_jsonl, run_cli, write_jsonl

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
OLD_TESTS = "from calc import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
NEW_TESTS = OLD_TESTS.replace("import sub", "import add, sub") + (
    "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
)
F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::test_sub"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def make_repo(repo: Path) -> tuple[str, str]:
    """-> (base commit, test patch)."""
    (repo / "tests").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(OLD_TESTS)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base: add() subtracts")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "tests" / "test_calc.py").write_text(NEW_TESTS)
    (repo / "tests" / "test_new.py").write_text("def test_new():\n    assert True\n")
    git(repo, "add", "-A")
    patch = git(repo, "diff", "--cached")
    git(repo, "reset", "-q", "--hard")
    (repo / "LATER").write_text("a commit after the base\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "later-commit-marker")
    return base, patch


def call(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def record(tid: str, base: str, patch: str, *replay: str) -> dict:
    return {
        "instance_id": tid,
        "problem_statement": "add() returns the difference instead of the sum.",
        "repo": "repos/calc",
        "base_commit": base,
        "test_patch": patch,
        "FAIL_TO_PASS": json.dumps(F2P),  # SWE-bench's JSON-list strings ...
        "PASS_TO_PASS": P2P,  # ... or plain lists
        "patch": "the gold patch (kept, never applied)",
        "replay": [*replay],
    }


def test_spec_and_apply_script(tmp_path):
    base, patch = make_repo(tmp_path / "repos" / "calc")
    spec = parse_spec(record("x", base, patch), tmp_path)
    assert spec is not None and spec.fail_to_pass == tuple(F2P) and spec.pass_to_pass == tuple(P2P)
    assert patched_paths(patch) == ["tests/test_calc.py", "tests/test_new.py"]
    script = apply_script(spec)
    assert (
        f"checkout -q {base} -- tests/test_calc.py" in script
        and "rm -f -- tests/test_new.py" in script
    )


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"repo": "../elsewhere"}, "must be a path relative to"),
        ({"repo": "repos/link"}, "is a symlink"),
        ({"repo": "repos"}, "is not a git repository or mirror"),
        ({"base_commit": None}, 'needs "base_commit"'),
        ({"FAIL_TO_PASS": "[not json"}, "not a JSON list"),
        ({"eval": "true"}, "two evaluations"),
        ({"workspace": "repos"}, "two starting points"),
    ],
)
def test_bad_swebench_records_are_named(tmp_path, change, why):
    base, patch = make_repo(tmp_path / "repos" / "calc")
    (tmp_path / "repos" / "link").symlink_to(tmp_path / "repos" / "calc")
    rec = {**record("x", base, patch), **change}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({k: v for k, v in rec.items() if v is not None}) + "\n")
    (ok,) = [{"id": "fine", "prompt": "p"}]
    with path.open("a") as f:
        f.write(json.dumps(ok) + "\n")
    tasks, errors, _ = load_tasks(str(path))
    assert [t.id for t in tasks] == ["fine"]
    assert errors[0].line == 1 and why in errors[0].reason, errors[0].reason


def test_swebench_record_end_to_end(tmp_path, needs_bwrap):
    base, patch = make_repo(tmp_path / "repos" / "calc")
    fix = call(
        "str_replace_editor",
        command="str_replace",
        path="/work/calc.py",
        old_str="def add(a, b):\n    return a - b",
        new_str="def add(a, b):\n    return a + b",
    )
    submit = call("submit", answer="done")
    records = [
        # fixed with the editor; it looks at the history first (the base, not the later commit)
        record("fixed", base, patch, call("bash", command="git log --oneline; ls"), fix, submit),
        record("untouched", base, patch, submit),
        # fixes add but breaks sub with bash, and edits the test file (restored by the eval)
        record(
            "broke-p2p",
            base,
            patch,
            call(
                "bash",
                command="sed -i 's/return a - b/return a + b/g' calc.py && "
                "echo 'def test_add(): pass' > tests/test_calc.py",
            ),
            submit,
        ),
    ]
    data = tmp_path / "swe.jsonl"
    write_jsonl(data, records)
    out = tmp_path / "out"
    run_cli(
        "--tasks",
        str(data),
        "--out",
        str(out),
        "--engine",
        "replay",
        "--policy",
        "none",
        "--tool-timeout",
        "30",
    )
    by_id = {t["task_id"]: t for t in read_jsonl(out / "trajectories.jsonl")}
    fixed, untouched, broke = by_id["fixed"], by_id["untouched"], by_id["broke-p2p"]

    log = fixed["step_log"][0]["observation"]
    assert "base: add() subtracts" in log and "later-commit-marker" not in log
    assert "LATER" not in log and "calc.py" in log
    assert fixed["setup"]["git"]["kind"] == "existing"
    assert "return a + b" in fixed["patch"]["diff"]

    ev = fixed["eval"]
    assert (ev["solved"], ev["exit_code"], ev["command"]) == (True, 0, DEFAULT_TEST_CMD)
    assert ev["tests"] == {
        "test_patch": "applied",
        "FAIL_TO_PASS": {"passed": F2P, "failed": [], "unknown": []},
        "PASS_TO_PASS": {"passed": P2P, "failed": [], "unknown": []},
    }

    ev = untouched["eval"]
    assert ev["solved"] is False and ev["exit_code"] != 0 and "test_add" in ev["output_tail"]
    assert ev["tests"]["FAIL_TO_PASS"]["failed"] == F2P
    assert ev["tests"]["PASS_TO_PASS"]["passed"] == P2P

    ev = broke["eval"]
    assert ev["solved"] is False
    assert ev["tests"]["FAIL_TO_PASS"]["passed"] == F2P
    assert ev["tests"]["PASS_TO_PASS"]["failed"] == P2P

    validator = jsonschema.Draft202012Validator(
        json.loads(
            (ROOT / "runner" / "runfolder" / "schemas" / "trajectory.schema.json").read_text()
        )
    )
    for t in by_id.values():
        validator.validate(t)

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["solved"], summary["evaluated"]) == (1, 3)


def test_a_bare_mirror_owned_by_another_user_is_cloned_at_the_base(tmp_path):
    """As SWE-bench users keep them (`git clone --mirror`), and not root's: git's
    ownership check must accept that one repository, and the later commit must not show."""
    base, patch = make_repo(tmp_path / "src")
    mirror = tmp_path / "repos" / "calc.git"
    subprocess.run(
        ["git", "clone", "-q", "--mirror", str(tmp_path / "src"), str(mirror)], check=True
    )
    subprocess.run(["chown", "-R", "4321:4321", str(tmp_path / "repos")], check=True)
    spec = parse_spec({**record("m", base, patch), "repo": "repos/calc.git"}, tmp_path)
    assert spec is not None
    ws = tmp_path / "ws"
    ws.mkdir()
    checkout(ws, spec, 2**28)
    assert git(ws, "log", "--format=%s").split("\n")[0] == "base: add() subtracts"
    assert git(ws, "remote") == "" and not (ws / "LATER").exists()
    assert (ws / "calc.py").read_text() == BUGGY
