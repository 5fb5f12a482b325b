"""--config run.toml: options from a file (flags win), errors naming key and file, the
resolved run.toml read back, the run record in run.json, resuming with other options
refused."""

import argparse
import json
from pathlib import Path

import pytest

from runner.batch.batch import BatchConfig
from runner.cli.config import parse_args, resolved, run_record, to_toml
from runner.cli.main import Plan, main, policy_from_args, resume
from runner.cli.parser import build_parser
from runner.runfolder.store import RunStore
from runner.tasks.tasks import Task


def toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def test_config_sets_options_and_flags_win(tmp_path):
    cfg = toml(
        tmp_path,
        'tasks = "a.jsonl"\nmax-steps = 4\npolicy = "none"\nkeep_workspaces = true\n'
        'engine_arg = ["k=v", "x=y"]\ntemperature = 0\n',
    )
    args = parse_args(build_parser(), ["--config", str(cfg), "--policy", "agent-cap:2"])
    assert (args.tasks, args.max_steps, args.keep_workspaces) == ("a.jsonl", 4, True)
    assert args.policy == "agent-cap:2"  # the flag wins
    assert args.engine_arg == ["k=v", "x=y"] and args.temperature == 0.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_stepz = 4\n", "unknown key 'max_stepz'"),
        ('max_steps = "four"\n', "key 'max_steps': expected an integer, got 'four'"),
        ('pause_rule = "random"\n', "key 'pause_rule': 'random' is not one of"),
        ("keep_workspaces = 1\n", "key 'keep_workspaces': expected true or false"),
        ("engine = 3\n", "key 'engine': expected a string"),
        ("max_steps = [\n", "not TOML"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, capsys, text, message):
    cfg = toml(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and message in err


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["--config", str(tmp_path / "nope.toml")])
    assert "nope.toml: cannot read it" in capsys.readouterr().err


def test_resolved_run_toml_reads_back(tmp_path):
    argv = ["--tasks", "a.jsonl", "--policy", "wset", "--engine-arg", 'a="b"', "--max-steps", "3"]
    args = build_parser().parse_args(argv)
    cfg = toml(tmp_path, to_toml(resolved(args)))
    again = parse_args(build_parser(), ["--config", str(cfg)])
    assert resolved(again) == {**resolved(args), "config": str(cfg)}


def test_run_record_is_written_once(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    store = RunStore(tmp_path / "run")
    rec = run_record({"policy": "aimd"}, data)
    meta = store.bind_source(str(data), rec)
    assert meta["config"] == {"policy": "aimd"} and len(meta["dataset_hash"]) == 64
    assert "concur-runner" in meta["packages"] and "matplotlib" in meta["packages"]
    assert meta["git_commit"] is None or len(meta["git_commit"].split("-")[0]) == 40
    again = store.bind_source(str(data), run_record({"policy": "none"}, data))
    assert again["config"] == {"policy": "aimd"}  # never rewritten
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["policy"] == "aimd"


def test_resume_with_options_that_change_results_is_refused(tmp_path, capsys):
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    out = tmp_path / "run"
    first = ["--tasks", str(data), "--out", str(out), "--engine", "replay"]
    args = build_parser().parse_args(first)
    policy_from_args(args)  # as a run records it: the default policy and its rules set
    assert (args.policy, args.pause_rule, args.resume_rule) == ("wset2", "newest", "newest")
    RunStore(out).bind_source(str(data.resolve()), run_record(resolved(args), data))
    code = main([*first, "--policy", "none", "--temperature", "0.2", "--progress-interval", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--policy ('wset2' -> 'none')" in err and "--temperature (0.6 -> 0.2)" in err
    assert "--resume-rule ('newest' -> 'oldest')" in err  # none's own rule
    assert "progress-interval" not in err  # display-only: may differ
    assert f"--config {out / 'run.toml'}" in err
    again = parse_args(build_parser(), ["--config", str(out / "run.toml")])
    assert again.policy == "wset2" and again.engine == "replay"


def test_a_run_made_under_the_old_default_policy_is_not_resumed_under_the_new(tmp_path, capsys):
    # run folders made before the default became wset2 recorded policy aimd, resume oldest
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    out = tmp_path / "run"
    first = ["--tasks", str(data), "--out", str(out), "--engine", "replay"]
    old = {**resolved(build_parser().parse_args(first)), "policy": "aimd"}
    old.update(pause_rule="newest", resume_rule="oldest")
    RunStore(out).bind_source(str(data.resolve()), run_record(old, data))
    assert main(first) == 2
    err = capsys.readouterr().err
    assert "--policy ('aimd' -> 'wset2')" in err and "--resume-rule ('oldest' -> 'newest')" in err
    assert f"--config {out / 'run.toml'}" in err


def test_aimd_flags_without_a_policy_name_the_default_and_the_way_out(tmp_path, capsys):
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    out = tmp_path / "run"
    argv = ["--tasks", str(data), "--out", str(out), "--engine", "replay", "--alpha", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--alpha: AIMD's parameters; the default policy is wset2" in err
    assert "--policy aimd" in err and not out.exists()
    args = build_parser().parse_args([*argv, "--policy", "aimd"])
    p = policy_from_args(args)
    assert (p.name, p.alpha, args.resume_rule) == ("aimd", 4, "oldest")


@pytest.mark.parametrize("keep", [False, True])
def test_agents_that_ended_in_error_run_again_unless_keep_errors(tmp_path, keep):
    store = RunStore(tmp_path / "run")
    store.add_trajectories([{"task_id": "a", "status": "error", "reason": "engine died"}])
    store.add_trajectories([{"task_id": "b", "status": "submitted"}])
    tasks = [Task(id=i, messages=[{"role": "user", "content": i}]) for i in "abc"]
    plan = Plan(tasks, [], "t.jsonl", tmp_path / "run", BatchConfig())
    todo = resume(argparse.Namespace(keep_errors=keep), plan, store)
    assert [t.id for t in todo] == (["c"] if keep else ["a", "c"])
    errors = tmp_path / "run" / "errors.jsonl"
    assert errors.exists() != keep  # the old line moved aside only when it runs again
