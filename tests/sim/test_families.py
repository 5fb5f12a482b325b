"""bench/families.py: the generated workload families of issue 31 and their checks."""

import json
import shlex
from collections import Counter

from bench import families
from runner.sim.engine import deployment
from tests.conftest import run_cli


def test_instances_are_drawn_each_from_its_own_seed():
    assert families.draw(17) == families.instances(30)[17] == families.instances(240)[17]
    assert families.draw(17) != families.draw(18)


def test_the_families_cover_their_ranges():
    insts = families.instances()
    assert len(insts) >= 200
    assert all(16 <= i.agents <= 4096 and 0.5 <= i.pool_scale <= 2.0 for i in insts)
    assert min(i.agents for i in insts) < 32 and max(i.agents for i in insts) > 3000
    assert set(Counter(i.tools for i in insts)) == {"fast", "bimodal", "heavy"}
    assert set(Counter(i.steps for i in insts)) == {"uniform", "long-tail"}
    assert {i.deployment for i in insts} == set(families.DEPLOYMENTS)
    assert any(i.spikes for i in insts) and not all(i.spikes for i in insts)
    assert any(i.host for i in insts) and not all(i.host for i in insts)
    assert any(i.system == 0 for i in insts) and max(i.system for i in insts) > 8_000
    for inst in insts[:40]:  # every agent fits the model's context
        w = inst.workload(0)
        limit = deployment(inst.deployment).max_context
        assert len(w.agents) == inst.agents
        assert all(w.system_tokens + a.total_tokens() < limit for a in w.agents), inst.key


def test_every_system_does_the_same_work_above_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "RUNS", tmp_path)
    inst = min(families.instances(), key=lambda i: i.agents * sum(i.options["steps"]))
    runs = [families.execute((inst, 0, s)) for s in ("none", "agent-cap:16", "wset2")]
    bound = families.bound(inst, 0)
    assert families.checks(runs, [bound]) == []
    assert len({r["work_digest"] for r in runs}) == 1
    assert all(r["by_status"] == {"submitted": inst.agents} for r in runs)


def _run(inst, system, seconds, digest="d"):
    return {"instance": inst, "seed": 0, "system": system, "sim_seconds": seconds,
            "work_digest": digest}  # fmt: skip


def test_the_checks_name_different_work_and_runs_below_the_bound():
    runs = [_run("f1", "none", 100), _run("f1", "aimd", 90, "other")]
    problems = families.checks(runs, [{"instance": "f1", "seed": 0, "bound_seconds": 95}])
    assert problems == [
        "f1 seed 0: the systems did different work (2 digests)",
        "f1 seed 0 aimd: 90.0 s is below its bound 95.0 s",
    ]


def test_criterion_against_the_best_baseline_and_the_best_known():
    runs = []
    for inst, times in {"a": (100, 200, 101), "b": (100, 120, 115), "c": (300, 100, 90)}.items():
        none, aimd, cand = times
        runs += [_run(inst, "none", none), _run(inst, "aimd", aimd), _run(inst, "cand", cand)]
    k = families.criterion(runs, "cand", baselines=("none", "aimd"))
    assert k["cells"] == 3
    assert k["within_2pct"] == 2 / 3  # a (1.01) and c (0.9); b is 1.15
    assert k["worst"] == (1.15, ("b", 0)) and k["over_10pct"] == [("b", 0)]
    assert abs(k["geomean_vs_best_known"] - (1.01 * 1.15 * 1.0) ** (1 / 3)) < 1e-9


def test_the_recorded_cli_line_reproduces_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "RUNS", tmp_path / "runs")
    inst = next(i for i in families.instances() if i.host and i.agents <= 40)  # a host tier too
    rec = families.execute((inst, 0, "wset2"))
    trace = tmp_path / f"{inst.key}-s0.jsonl"
    inst.workload(0).save(trace)
    argv = shlex.split(rec["cli"])[2:]  # after "python run.py"
    argv[argv.index("--workload") + 1] = str(trace)
    assert "--sim-pool-scale" in argv
    run_cli(*argv, "--out", str(tmp_path / "cli"))
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["batch_seconds"] == rec["sim_seconds"]
