"""Workload families (issue 31): simulated workloads drawn from ranges at fixed seeds, so that
a policy is judged on many workloads it was not tuned on, not on twelve fixed rows.

Each instance is drawn from its own seeded stream (`draw(i)`), independently of the others:
instance 17 is the same whatever `--instances` says. The ranges:

- agents: 16 to 4,096, log-uniform;
- tools: fast (log-uniform between a lower end of 0.1-1 s and an upper end of 1-8 s), bimodal
  (fast, plus 5-40% slow calls of 10-120 s) or heavy-tailed (Pareto, shape 1.1-2, from 0.2-2 s,
  cut at 300 s);
- observations: contexts growing from 256-2,048 tokens to 2-36K, spread unevenly over the
  steps, with spikes of 8-25K tokens on 1-8% of observations in 40% of instances;
- a shared system prompt of 0 (a quarter of instances) or 256 to 16K tokens;
- steps: 3-60 uniform, or a long tail (2-15% of agents take 40-100 steps);
- deployment: Qwen3-32B on TP2/4/8 or DeepSeek-V3 on TP16 (the paper's pool), with the KV pool
  scaled from half to double (log-uniform), and a host tier (HiCache, twice the pool) in 30%.

A run: `python -m bench.families run --systems none,aimd,... --seeds 0` runs every system on
every instance in the simulator (`simulate`, the real runner on virtual time) and appends one
line per run to bench/results/families/runs.jsonl (a rerun skips what is there). Every run of
an instance must do identical work (the same steps, tokens, per agent, across systems) and
none may beat the instance's lower bound (runner/sim/oracle.py); `report` checks both and
writes the criterion of issue 31 per policy. Simulated seconds are a model's, not
measurements (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import random
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common.paper_runs import CONTROL_PERIOD, HICACHE_RATIO, rules_of, work_digest
from bench.common.paths import FAMILIES_RESULTS as RESULTS
from bench.common.paths import FAMILIES_RUNS as RUNS
from runner.policies.registry import make_policy
from runner.sim.oracle import lower_bounds
from runner.sim.simulate import simulate
from runner.sim.workload import Workload, synthetic

N_INSTANCES = 240
DEPLOYMENTS = ("qwen3-32b-tp2", "qwen3-32b-tp4", "qwen3-32b-tp8", "deepseek-v3-tp16-paper")
CAPS = (16, 32, 64, 128)
BASELINES = ("none", "aimd", *(f"agent-cap:{n}" for n in CAPS))
MAX_CONTEXT = 36_000  # every agent's final context stays under the models' 40,960


@dataclass(frozen=True)
class Instance:
    key: str
    deployment: str
    pool_scale: float
    host: bool
    agents: int
    tools: str  # fast, bimodal, heavy
    spikes: bool
    system: int  # shared system prompt, tokens
    steps: str  # uniform, long-tail
    options: dict[str, Any] = field(default_factory=dict)  # synthetic()'s options

    def workload(self, seed: int) -> Workload:
        w = synthetic("paper", seed=seed, **self.options)
        return dataclasses.replace(w, name=self.key)

    def engine_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pool_scale": self.pool_scale}
        if self.host:
            out["hicache_ratio"] = HICACHE_RATIO
        return out

    def label(self) -> str:
        d = self.deployment.replace("qwen3-32b-", "qwen-").replace("deepseek-v3-tp16-paper", "ds")
        parts = [d, f"pool x{self.pool_scale:.2f}", f"{self.agents} agents", self.tools]
        parts += ["spikes"] if self.spikes else []
        parts += [f"prefix {self.system}"] if self.system else []
        parts += ["long tail"] if self.steps == "long-tail" else []
        parts += ["host tier"] if self.host else []
        return ", ".join(parts)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(i: int) -> Instance:
    """Instance i, from its own stream."""
    rng = random.Random(f"families-v1:{i}")
    dep = rng.choice(DEPLOYMENTS)
    pool_scale = round(_log_uniform(rng, 0.5, 2.0), 2)
    host = rng.random() < 0.3
    agents = round(_log_uniform(rng, 16, 4096))
    system = 0 if rng.random() < 0.25 else int(_log_uniform(rng, 256, 16_000))
    start = rng.randint(256, 2048)
    gen_lo = rng.randint(20, 80)
    gen = (gen_lo, rng.randint(2 * gen_lo, 300))
    opts: dict[str, Any] = {"agents": agents, "system": system, "start": start, "gen": gen}

    room = MAX_CONTEXT - system  # for an agent's own tokens
    steps_kind = rng.choice(("uniform", "long-tail"))
    if steps_kind == "uniform":
        lo = rng.randint(3, 20)
        opts["steps"] = (lo, min(60, rng.randint(lo + 2, 3 * lo + 5)))
    else:
        opts["steps"] = (rng.randint(3, 6), rng.randint(8, 14))
        tail_lo = rng.randint(40, 80)
        opts["long_steps"] = (
            round(rng.uniform(0.02, 0.15), 3),
            tail_lo,
            tail_lo + rng.randint(5, 20),
        )
    # An agent's context is at most max(final, start + its replies) + its spikes: the
    # replies' share is held to a third of the room, spikes get what final leaves.
    most = opts["long_steps"][2] if steps_kind == "long-tail" else opts["steps"][1]
    if most * gen[1] > room // 3:
        gen = (min(gen[0], room // 3 // most), max(1, room // 3 // most))
        opts["gen"] = gen
    cap = room  # the largest final context
    spikes = rng.random() < 0.4
    if spikes:
        s_lo = rng.randint(8_000, 15_000)
        s_hi = s_lo + rng.randint(2_000, 10_000)
        opts["spikes"] = (round(rng.uniform(0.01, 0.08), 3), s_lo, s_hi)
        opts["max_context"] = room - start - most * gen[1]  # spikes fit under it
        cap = opts["max_context"] - s_lo  # room left for at least one spike
    if steps_kind == "long-tail":
        # contexts grow per step, so that the long agents end large, not thin
        per_hi = max(60, (cap - start) // most)
        per_lo = max(30, per_hi // rng.randint(2, 4))
        opts["final_per_step"] = (per_lo, per_hi)
    else:
        hi_cap = max(start + 1_000, cap)
        final_lo = int(_log_uniform(rng, min(2_000, hi_cap // 2), max(2_001, min(24_000, hi_cap))))
        final_lo = max(start + 500, min(final_lo, hi_cap - 500))
        opts["final"] = (final_lo, min(hi_cap, int(final_lo * rng.uniform(1.2, 1.8))))

    tools = rng.choice(("fast", "bimodal", "heavy"))
    fast = (round(rng.uniform(0.1, 1.0), 2), round(rng.uniform(1.0, 8.0), 2))
    opts["tool_s"] = fast
    if tools == "bimodal":
        slow_lo = rng.uniform(10, 60)
        opts["slow_tools"] = (
            round(rng.uniform(0.05, 0.4), 3),
            round(slow_lo, 1),
            round(rng.uniform(1.2 * slow_lo, 120), 1),
        )
    elif tools == "heavy":
        opts["heavy_tools"] = (
            round(rng.uniform(1.1, 2.0), 2),
            round(rng.uniform(0.2, 2.0), 2),
            300.0,
        )
    return Instance(
        f"f{i:03d}", dep, pool_scale, host, agents, tools, spikes, system, steps_kind, opts
    )


def instances(n: int = N_INSTANCES) -> list[Instance]:
    return [draw(i) for i in range(n)]


# ---- runs -------------------------------------------------------------------------------


def cli(inst: Instance, seed: int, system: str, trace: str) -> str:
    """The `run.py` command that runs the same batch (with the instance's trace written by
    `python -m bench.families trace KEY --seed S`)."""
    pause, resume = rules_of(system)
    argv = ["--engine", "sim", "--workload", trace, "--sim-deployment", inst.deployment]
    argv += ["--sim-pool-scale", f"{inst.pool_scale:g}", "--policy", system]
    argv += ["--control-period", f"{CONTROL_PERIOD:g}", "--pause-rule", pause]
    argv += ["--resume-rule", resume]
    if inst.host:
        argv += ["--hicache-ratio", f"{HICACHE_RATIO:g}"]
    return "python run.py " + shlex.join(argv)


def execute(job: tuple[Instance, int, str]) -> dict[str, Any]:
    inst, seed, system = job
    pause, resume = rules_of(system)
    out = RUNS / f"{inst.key}-s{seed}-{system.replace(':', '')}"
    r = simulate(
        inst.workload(seed),
        inst.deployment,
        make_policy(system),
        out,
        control_period=CONTROL_PERIOD,
        pause_rule=pause,
        resume_rule=resume,
        engine_options=inst.engine_options(),
        label=system,
    )
    shutil.rmtree(out, ignore_errors=True)  # 4,096 agents' trajectories: not kept
    rec = {
        "instance": inst.key,
        "seed": seed,
        "system": system,
        "sim_seconds": r.sim_seconds,
        "wall_seconds": round(r.wall_seconds, 2),
        "hit_rate": r.hit_rate,
        "by_status": r.by_status,
        "work_digest": work_digest(r.work),
        "evicted_tokens": r.engine.get("evicted_tokens"),
        "recomputed_tokens": r.engine.get("tokens_prefill_recompute"),
        "cli": cli(inst, seed, system, f"{inst.key}-s{seed}.jsonl"),
    }
    print(
        f"  {inst.key} s{seed} {system:14s} {r.sim_seconds:9.1f} sim s "
        f"({r.wall_seconds:.1f} s wall)",
        flush=True,
    )
    return rec


def bound(inst: Instance, seed: int) -> dict[str, Any]:
    """The instance's lower bound (the device bound; with a host tier, the host bound)."""
    device, host = lower_bounds(inst.workload(seed), inst.deployment, pool_scale=inst.pool_scale)
    b = host if inst.host else device
    return {"instance": inst.key, "seed": seed, "bound_seconds": b["bound_seconds"]}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(insts: list[Instance], seeds: list[int], systems: list[str], jobs: int) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs_path, bounds_path = RESULTS / "runs.jsonl", RESULTS / "bounds.jsonl"
    done = {(r["instance"], r["seed"], r["system"]) for r in read_jsonl(runs_path)}
    have_bounds = {(r["instance"], r["seed"]) for r in read_jsonl(bounds_path)}
    todo = [
        (inst, seed, s)
        for inst in insts
        for seed in seeds
        for s in systems
        if (inst.key, seed, s) not in done
    ]
    # the largest first, so that the pool's last minutes are not one 4,096-agent run
    todo.sort(key=lambda j: -j[0].agents * sum(j[0].options["steps"]))
    need = [(i, s) for i in insts for s in seeds if (i.key, s) not in have_bounds]
    t0 = time.monotonic()
    print(f"{len(todo)} runs, {len(need)} bounds, {jobs} at a time", flush=True)
    with mp.get_context("spawn").Pool(jobs) as pool:
        with bounds_path.open("a") as f:
            for b in pool.imap_unordered(_bound, need):
                f.write(json.dumps(b) + "\n")
                f.flush()
        with runs_path.open("a") as f:
            for rec in pool.imap_unordered(execute, todo):
                f.write(json.dumps(rec) + "\n")
                f.flush()
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)


def _bound(job: tuple[Instance, int]) -> dict[str, Any]:
    return bound(*job)


# ---- report -----------------------------------------------------------------------------


def seconds_by_cell(runs: Iterable[dict[str, Any]]) -> dict[tuple[str, int], dict[str, float]]:
    """(instance, seed) -> system -> simulated seconds."""
    by: dict[tuple[str, int], dict[str, float]] = {}
    for r in runs:
        by.setdefault((r["instance"], r["seed"]), {})[r["system"]] = r["sim_seconds"]
    return by


def bounds_by_cell(bounds: Iterable[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(instance, seed) -> its lower bound, seconds."""
    return {(x["instance"], x["seed"]): x["bound_seconds"] for x in bounds}


def criterion(
    runs: Iterable[dict[str, Any]], candidate: str, baselines: tuple[str, ...] = BASELINES
) -> dict[str, Any]:
    """Issue 31's criterion 3 over (instance, seed) cells where the candidate and every
    baseline ran: the share within 2% of the best baseline, the worst ratio, and the
    geometric mean of the ratio to the best known (the fastest of every system run there)."""
    ratios, known = [], []
    for cell, t in sorted(seconds_by_cell(runs).items()):
        if candidate not in t or any(b not in t for b in baselines):
            continue
        best = min(t[b] for b in baselines)
        ratios.append((t[candidate] / best, cell))
        known.append(t[candidate] / min(t.values()))
    if not ratios:
        return {"cells": 0}
    return {
        "cells": len(ratios),
        "within_2pct": sum(r <= 1.02 for r, _ in ratios) / len(ratios),
        "worst": max(ratios),
        "over_10pct": sorted((c for r, c in ratios if r > 1.10)),
        "geomean_vs_best_known": math.exp(statistics.fmean(math.log(x) for x in known)),
    }


def checks(runs: list[dict[str, Any]], bounds: list[dict[str, Any]]) -> list[str]:
    """Identical work across the systems of each (instance, seed), and no run below its
    bound: the problems found, one line each."""
    problems = []
    digests: dict[tuple[str, int], set[str]] = {}
    for r in runs:
        digests.setdefault((r["instance"], r["seed"]), set()).add(r["work_digest"])
    for cell, d in sorted(digests.items()):
        if len(d) > 1:
            problems.append(
                f"{cell[0]} seed {cell[1]}: the systems did different work ({len(d)} digests)"
            )
    b = bounds_by_cell(bounds)
    for r in runs:
        lb = b.get((r["instance"], r["seed"]))
        if lb is not None and r["sim_seconds"] < lb * (1 - 1e-9):
            problems.append(
                f"{r['instance']} seed {r['seed']} {r['system']}: {r['sim_seconds']:.1f} s "
                f"is below its bound {lb:.1f} s"
            )
    return problems


def report(candidates: list[str]) -> str:
    runs = read_jsonl(RESULTS / "runs.jsonl")
    bounds = read_jsonl(RESULTS / "bounds.jsonl")
    insts = {i.key: i for i in instances(N_INSTANCES)}
    lines = ["# Workload families (issue 31)", ""]
    cells = {(r["instance"], r["seed"]) for r in runs}
    seeds = sorted({seed for _, seed in cells})
    lines += [
        f"{len(runs)} runs over {len(cells)} (instance, seed) cells: "
        f"{len({k for k, _ in cells})} of the {N_INSTANCES} instances, seeds "
        f"{', '.join(map(str, seeds))} (issue 31 asks for all at seeds 0-3); generated by "
        "`python -m bench.families`; simulated seconds (a model, docs/simulator.md).",
        "",
    ]
    problems = checks(runs, bounds)
    lines += ["## Checks", ""]
    lines += [f"- {p}" for p in problems] or [
        "- every cell's runs did identical work, and no run is below its bound"
    ]
    lines += ["", "## Criterion 3 per policy", ""]
    lines += [
        "| policy | cells | within 2% of the best baseline | worst ratio (where) "
        "| cells over 10% | geo. mean vs best known |",
        "|---|---|---|---|---|---|",
    ]
    for c in candidates:
        k = criterion(runs, c)
        if not k["cells"]:
            continue
        worst, (wi, ws) = k["worst"]
        lines.append(
            f"| `{c}` | {k['cells']} | {100 * k['within_2pct']:.1f}% | {worst:.2f} ({wi} s{ws}) "
            f"| {len(k['over_10pct'])} | {k['geomean_vs_best_known']:.3f} |"
        )
    lines += ["", "## Instances", ""]
    lines += ["| instance | what | bound s | " + " | ".join(candidates) + " |"]
    lines += ["|---" * (3 + len(candidates)) + "|"]
    b = bounds_by_cell(bounds)
    for (key, seed), v in sorted(seconds_by_cell(runs).items()):
        cols = [f"{v[c]:,.0f}" if c in v else "-" for c in candidates]
        lb = b.get((key, seed))
        lines.append(
            f"| {key} s{seed} | {insts[key].label() if key in insts else '?'} | "
            f"{'-' if lb is None else f'{lb:,.0f}'} | " + " | ".join(cols) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run systems on instances (appends to runs.jsonl)")
    r.add_argument(
        "--instances", type=_indices, default=f"0-{N_INSTANCES - 1}", help="A-B or a,b,c"
    )
    r.add_argument("--seeds", default="0")
    r.add_argument("--systems", default=",".join((*BASELINES, "wset2")))
    r.add_argument("--max-agents", type=int, help="only instances with at most this many agents")
    r.add_argument("--jobs", type=int, default=2)
    rep = sub.add_parser("report", help="write results/families/families.md from runs.jsonl")
    rep.add_argument("--systems", default=",".join((*BASELINES, "wset2")))
    ls = sub.add_parser("list", help="print the instances")
    ls.add_argument("--instances", type=_indices, default=f"0-{N_INSTANCES - 1}")
    tr = sub.add_parser("trace", help="write an instance's workload as a trace file for run.py")
    tr.add_argument("key", type=lambda k: _indices(k.removeprefix("f"))[0], help="e.g. f017")
    tr.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "trace":
        inst = draw(a.key)
        path = Path(f"{inst.key}-s{a.seed}.jsonl")
        inst.workload(a.seed).save(path)
        print(path)
        return
    if a.cmd == "report":
        text = report(a.systems.split(","))
        (RESULTS / "families.md").write_text(text)
        print(text)
        return
    chosen = [draw(i) for i in a.instances]
    if a.cmd == "list":
        for inst in chosen:
            print(inst.key, inst.label(), json.dumps(inst.options))
        return
    if a.max_agents:
        chosen = [i for i in chosen if i.agents <= a.max_agents]
    run(chosen, [int(s) for s in a.seeds.split(",")], a.systems.split(","), a.jobs)


def _indices(spec: str) -> list[int]:
    """Instance numbers from "A-B" or "a,b,c", each one of the N_INSTANCES."""
    try:
        if "-" in spec:
            lo, hi = spec.split("-")
            out = list(range(int(lo), int(hi) + 1))
        else:
            out = [int(x) for x in spec.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not A-B or a,b,c: {spec!r}") from None
    if not out or not all(0 <= i < N_INSTANCES for i in out):
        raise argparse.ArgumentTypeError(f"instances are 0-{N_INSTANCES - 1}: {spec!r}")
    return out


if __name__ == "__main__":
    sys.exit(main())
