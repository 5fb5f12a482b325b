"""The sim CLI reproduces bench runs exactly: the same seconds from `run.py` with the
arguments the bench records for a run (its `cli` field) as from the bench's own function."""

import dataclasses
import functools
import json
import shlex

import pytest

from bench import bounds
from bench.common import paper_runs, stress_runs
from tests.conftest import run_cli


@pytest.mark.parametrize(
    "name",
    # the capped DeepSeek pool, and a host tier with its size and reload rate set
    ["ds-32-aimd", "ds-32-hicache-host200-bw2"],
)
def test_cli_reproduces_paper_bench_run(tmp_path, name):
    run = next(r for r in paper_runs.plan("ds-32", quick=False) if r.name == name)
    rec = paper_runs.execute((run, 0), tmp_path / "bench")
    argv = shlex.split(rec["cli"])[2:]  # after "python run.py"
    run_cli(*argv, "--out", str(tmp_path / "cli"))
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["batch_seconds"] == rec["sim_seconds"]
    assert summary["agents_by_status"] == {"submitted": 32}


def test_bounds_report_flags_a_run_faster_than_its_bound():
    # bench/bounds.py recomputes every row's bound without rerunning: a recorded run faster
    # than its row's bound is named (and makes the script exit 1); the others are not
    recs = [
        {"run": "qwen-tp8-wset", "config": "qwen-tp8", "system": "wset", "sim_seconds": 539.0},
        {"run": "qwen-tp8-fast", "config": "qwen-tp8", "system": "aimd", "sim_seconds": 100.0},
    ]
    text, faster = bounds.report(recs)
    assert faster == ["qwen-tp8-fast"]
    device, _ = bounds.lower_bounds(bounds.synthetic("paper", seed=0), "qwen3-32b-tp8")
    b = device["bound_seconds"]
    assert f"| Qwen3-32B, 256 agents, TP8 | {b:,.0f} |" in text
    assert f"| 539 | {539 / b:.2f} |" in text  # wset against it


def _engine_settings(engine) -> dict:
    """A simulated engine's settings: its attributes (and its cost model's) that are plain
    values or dataclasses (the deployment); its live state (caches, queues) left out."""
    plain = (int, float, str, bool, type(None))

    def settings(obj) -> dict:
        return {
            k: v
            for k, v in vars(obj).items()
            if isinstance(v, plain) or dataclasses.is_dataclass(v)
        }

    return {**settings(engine), "cost": settings(engine.cost)}


def test_every_bench_run_parses_to_the_settings_the_bench_simulates(tmp_path, monkeypatch):
    # every run of paper.py and stress.py (every system, row and sweep): its `cli` line, as
    # run.py parses it, gives the tasks, engine, batch settings and policy that the bench
    # hands the simulator. A setting only the bench can set (the DeepSeek pool cap was one)
    # makes them differ. Without running the simulations.
    from runner.cli.engines import constrain_tool_calls
    from runner.cli.main import check_options, config_args, policy_from_args, simulation_plan
    from runner.cli.parser import build_parser
    from runner.policies.registry import make_policy
    from runner.sim import simulate

    workloads = functools.cache(simulate.load_workload)  # each preset generated once
    monkeypatch.setattr(simulate, "load_workload", workloads)
    runs = [*paper_runs.plan(None, quick=False), *stress_runs.plan(None, None)]
    assert len(runs) > 200 and len({r.system for r in runs}) > 40  # every kind
    for run in runs:
        argv = [*paper_runs.cli_args(run, 0), "--out", str(tmp_path / "cli")]
        args = config_args(build_parser(), argv)
        check_options(args)
        cli = simulation_plan(args)
        assert cli.setup is not None
        cli.config.constrain_tool_calls = constrain_tool_calls(
            args.constrain_tool_calls, cli.setup.engine
        )  # as run.py's run() sets it
        parts, config = simulate.sim_setup(
            workloads(run.workload, 0), run.deployment, **paper_runs.sim_settings(run)
        )
        assert policy_from_args(args) == make_policy(paper_runs.policy_spec(run)), run.name
        assert cli.config == config, run.name
        assert _engine_settings(cli.setup.engine) == _engine_settings(parts.engine), run.name
        assert cli.tasks == parts.tasks, run.name
