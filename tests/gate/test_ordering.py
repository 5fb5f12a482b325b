"""--order-from: tasks a previous run found long start first (runner/gate/ordering.py)."""

import dataclasses
import json

import pytest

from runner.cli.config import parse_args as config_args
from runner.cli.main import main, make_plan
from runner.cli.parser import build_parser
from runner.gate.ordering import longest_first, previous_lengths
from runner.policies.registry import make_policy
from runner.sim.simulate import simulate
from runner.sim.workload import synthetic
from tests.conftest import run_cli


def write_run(folder, records):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (folder / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def rec(tid, gen, tool):
    return {"task_id": tid, "gen_seconds": gen, "tool_seconds": tool, "seconds": 99.0}


def test_unknown_first_then_longest_first_ties_in_order():
    seconds = {"a": 1.0, "b": 5.0, "c": 5.0, "d": 9.0}
    items = ["x", "a", "b", "y", "c", "d"]
    assert longest_first(items, seconds, str) == ["x", "y", "d", "b", "c", "a"]
    assert longest_first(items, {}, str) == items


def test_previous_lengths_reads_a_folder_or_its_file_last_record_wins(tmp_path):
    run = write_run(
        tmp_path / "prev",
        [rec("a", 1.0, 2.0), "{torn", rec("b", 4.0, 0.5), rec("a", 10.0, 0.0), '{"no": 1}'],
    )
    for path in (run, run / "trajectories.jsonl"):
        got = previous_lengths(path)
        # generating and tool seconds; the gate waits (in `seconds`) are left out
        assert got.seconds == {"a": 10.0, "b": 4.5} and got.unreadable == 2


def test_previous_lengths_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"no trajectories\.jsonl"):
        previous_lengths(tmp_path / "missing")
    empty = write_run(tmp_path / "empty", ["{torn"])
    with pytest.raises(ValueError, match="holds no trajectory record"):
        previous_lengths(empty)


def plan_of(*argv):
    plan, note = make_plan(config_args(build_parser(), list(argv)))
    return [t.id for t in plan.tasks], note


def test_a_dataset_plan_puts_the_longest_first(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"id": t, "prompt": "hi"}) + "\n" for t in "abcde"))
    prev = write_run(tmp_path / "prev", [rec("b", 1, 1), rec("c", 30, 0), rec("d", 5, 5)])
    ids, note = plan_of("--tasks", str(data), "--order-from", str(prev))
    assert ids == ["a", "e", "c", "d", "b"]  # those not in prev first, in the dataset's order
    assert note[0] and "3 of 5 tasks found there; the 2 others first" in note[1]
    ids, note = plan_of("--tasks", str(data))
    assert ids == list("abcde") and note is None
    # --samples: each sample is a task of its own, found by its own id
    prev = write_run(tmp_path / "prev2", [rec("a#1", 9, 0), rec("a#0", 1, 0), rec("b#0", 5, 0)])
    ids, _ = plan_of(
        "--tasks", str(data), "--limit", "2", "--samples", "2", "--order-from", str(prev)
    )  # fmt: skip
    assert ids == ["b#1", "a#1", "b#0", "a#0"]


def test_a_run_with_none_of_the_tasks_keeps_the_dataset_order_and_warns(tmp_path, caplog):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"id": t, "prompt": "hi"}) + "\n" for t in "abc"))
    prev = write_run(tmp_path / "prev", [rec("zz", 1, 1)])
    ids, note = plan_of("--tasks", str(data), "--order-from", str(prev))
    assert ids == ["a", "b", "c"] and not note[0] and "none of the 3 tasks is in" in note[1]
    out = tmp_path / "run"
    code = main(
        ["--tasks", str(data), "--engine", "replay", "--sandbox", "none", "--out", str(out),
         "--order-from", str(prev)]
    )  # fmt: skip
    assert code == 0 and (out / "trajectories.jsonl").read_text().count("\n") == 3
    assert any(r.levelname == "WARNING" and "none of the 3" in r.message for r in caplog.records)


def test_a_bad_order_from_is_an_error_before_anything_runs(tmp_path, capsys):
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    out = tmp_path / "run"
    code = main(["--tasks", str(data), "--engine", "replay", "--out", str(out),
                 "--order-from", str(tmp_path / "nope")])  # fmt: skip
    assert code == 2 and "--order-from" in capsys.readouterr().err and not out.exists()


def test_the_sim_cli_reproduces_a_reordered_simulated_batch(tmp_path):
    """What bench/order.py measures: a second pass ordered by the first. The CLI, given the
    first pass's folder, runs the same batch as `simulate` on the reordered workload."""
    w = synthetic("tiny", seed=0)
    first = simulate(w, "tiny-cpu", make_policy("agent-cap:2"), tmp_path / "first")
    lengths = previous_lengths(tmp_path / "first")
    agents = longest_first(w.agents, lengths.seconds, lambda a: a.id)
    ordered = dataclasses.replace(w, agents=agents)
    assert [a.id for a in ordered.agents] != [a.id for a in w.agents]  # the test orders
    second = simulate(ordered, "tiny-cpu", make_policy("agent-cap:2"), tmp_path / "second")
    assert second.work == first.work  # the same work, in another order
    p = run_cli(
        "--engine", "sim", "--workload", "tiny", "--workload-seed", "0", "--sim-deployment",
        "tiny-cpu", "--policy", "agent-cap:2", "--out", str(tmp_path / "cli"),
        "--order-from", str(tmp_path / "first"),
    )  # fmt: skip
    # a window that does not look at contexts: told that the long first can overcommit
    assert "--policy agent-cap, which does not fit the agents' contexts" in p.stderr
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["batch_seconds"] == pytest.approx(second.sim_seconds, abs=1e-3)
    admitted = [a for line in (tmp_path / "cli" / "control.jsonl").open()
                for a in json.loads(line).get("admitted", [])]  # fmt: skip
    assert admitted == [a.id for a in ordered.agents]


def test_a_policy_that_fits_contexts_is_not_warned(tmp_path, caplog):
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "hi"}\n')
    prev = write_run(tmp_path / "prev", [rec("b", 3, 0)])
    code = main(
        ["--tasks", str(data), "--engine", "replay", "--sandbox", "none", "--policy", "wset2",
         "--out", str(tmp_path / "run"), "--order-from", str(prev)]
    )  # fmt: skip
    assert code == 0 and "1 of 2 tasks found there" in caplog.text
    assert "does not fit the agents' contexts" not in caplog.text


def test_a_run_folder_resumes_with_another_order(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "hi"}\n')
    out = tmp_path / "run"
    common = ["--tasks", str(data), "--engine", "replay", "--sandbox", "none", "--out", str(out)]
    run_cli(*common, "--task-ids", "a")
    prev = write_run(tmp_path / "prev", [rec("b", 3, 0)])
    # the order says who starts first, not what any task does: not refused
    p = run_cli(*common, "--order-from", str(prev))
    assert "1 already finished" in p.stderr and "1 of 2 tasks found there" in p.stderr
    done = [json.loads(x)["task_id"] for x in (out / "trajectories.jsonl").open()]
    assert sorted(done) == ["a", "b"]
