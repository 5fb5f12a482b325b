"""An explicit --max-steps caps every task, its own max_steps included; without the flag a
task's own max_steps wins over the default."""

import dataclasses
import json

from runner.batch.batch import Batch
from runner.batch.session import execute
from runner.cli.parser import build_parser
from runner.policies.registry import make_policy
from runner.runfolder.store import RunStore
from runner.sim.simulate import load_workload, sim_config, sim_parts
from runner.sim.tools import NullSandbox
from runner.sim.vclock import run_virtual


def run(tmp_path, cap, own):
    parts = sim_parts(load_workload("tiny"), "tiny-cpu")
    tasks = [dataclasses.replace(t, max_steps=own) for t in parts.tasks]
    config = dataclasses.replace(sim_config(parts), max_steps=20, max_steps_cap=cap)
    store = RunStore(tmp_path)
    batch = Batch(tasks, parts.engine, NullSandbox(), make_policy("aimd"), store, config)
    execute(batch, parts.engine, "test", task_ids=[t.id for t in tasks], invalid_records=0,
            config={}, run_loop=run_virtual)  # fmt: skip
    return [json.loads(line) for line in store.trajectories.open()]


def test_explicit_max_steps_caps_a_tasks_own(tmp_path):
    recs = run(tmp_path / "a", cap=2, own=10)
    assert recs and all(r["steps"] == 2 and r["status"] == "max_steps" for r in recs)


def test_without_the_flag_a_tasks_own_budget_wins(tmp_path):
    recs = run(tmp_path / "b", cap=None, own=1)
    assert recs and all(r["steps"] == 1 for r in recs)


def test_flag_not_given_is_none():
    assert build_parser().parse_args(["--tasks", "x"]).max_steps is None
    assert build_parser().parse_args(["--tasks", "x", "--max-steps", "4"]).max_steps == 4
