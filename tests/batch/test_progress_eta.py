"""The progress ETA comes from steps done against the step budget, so it shows long before
the first agent ends."""

import dataclasses

from runner.batch.batch import Batch
from runner.batch.progress import BatchStatus, eta, render
from runner.batch.session import execute
from runner.policies.registry import make_policy
from runner.runfolder.store import RunStore
from runner.sim.simulate import load_workload, sim_config, sim_parts
from runner.sim.tools import NullSandbox
from runner.sim.vclock import run_virtual


def status(**kw) -> BatchStatus:
    base = dict(done=0, total=10, active=10, paused=0, pending=0, window=10, steps=0,
                generated_tokens=0, hit=None, u=None, h=None, step_budget=100)  # fmt: skip
    return BatchStatus(**{**base, **kw})


def test_eta_from_steps_before_any_agent_ends():
    assert eta(status(steps=25), elapsed=60) == "<=180s"
    assert "ETA <=180s" in render(status(steps=25), 60)
    assert eta(status(steps=0), elapsed=5) == "-"
    assert eta(status(steps=5, step_budget=0, done=1), elapsed=10) == "90s"  # no budget


def test_batch_budget_shrinks_as_agents_finish_early(tmp_path):
    parts = sim_parts(load_workload("tiny"), "tiny-cpu")
    tasks = [dataclasses.replace(t, max_steps=50) for t in parts.tasks]
    batch = Batch(tasks, parts.engine, NullSandbox(), make_policy("aimd"),
                  RunStore(tmp_path), sim_config(parts))  # fmt: skip
    assert batch.status().step_budget == 50 * len(tasks)
    execute(batch, parts.engine, "test", task_ids=[t.id for t in tasks], invalid_records=0,
            config={}, run_loop=run_virtual)  # fmt: skip
    s = batch.status()
    assert s.done == len(tasks) and s.step_budget == s.steps  # every unused step given back
