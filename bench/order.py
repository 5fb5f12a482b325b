"""A second pass over the same tasks, the longest first by the first pass (`--order-from`).

    python bench/order.py                       # every paper and stress row, wset2 and aimd
    python bench/order.py --rows qwen-tp8 --systems wset2 --seeds 0,1

For every row, seed and system: pass 1 in the dataset's order (the run bench/paper.py and
bench/stress.py record), then pass 2, the same batch with its tasks ordered longest first by
pass 1's trajectories (runner/ordering.py: what `run.py ... --order-from <pass 1's folder>`
does; tests/test_ordering.py holds the CLI to this script's simulation of it), and, for the
first system, the clairvoyant order for reference: longest first by each agent's own serial
chain in the trace (the oracle's, runner/sim/oracle.py), which no run can know beforehand.

Assumption, stated: the simulator's second pass sees the same trace, every agent the same
work, so pass 1 predicts each task's length perfectly up to the batching it ran in. A real
model's next pass over the same tasks samples again (another RL epoch, another seed), and its
lengths follow the previous ones only as far as the tasks decide them; the gain measured here
is what the order is worth when they do. Every run is checked for the same work as its pass 1
and against the row's lower bound. Writes bench/results/order.json and order.md; simulated
seconds from the simulator's cost model, not from real GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing as mp
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import paper  # noqa: E402
import stress  # noqa: E402

from runner.ordering import longest_first, previous_lengths  # noqa: E402
from runner.policies import make_policy  # noqa: E402
from runner.sim.engine import CostModel  # noqa: E402
from runner.sim.engine import deployment as sim_deployment  # noqa: E402
from runner.sim.oracle import _totals, lower_bound  # noqa: E402
from runner.sim.simulate import simulate  # noqa: E402
from runner.sim.workload import Workload, synthetic  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "outputs" / "bench-order"
ORDERS = ("dataset", "previous", "clairvoyant")


def rows() -> dict[str, tuple[str, str, str]]:
    """key -> (title, deployment, workload) of every paper row and stress row."""
    out = {c.key: (c.title, c.deployment, c.workload) for c in paper.TABLE1}
    return out | {r.key: (r.title, r.deployment, r.workload) for r in stress.ROWS}


def bench_run(key: str, system: str) -> paper.Run:
    """The run bench/paper.py or bench/stress.py makes of this row and system."""
    runs = [r for r in stress.plan(key, [system])]
    runs += [r for r in paper.plan(key, True) if r.system == system] if not runs else []
    if not runs:
        raise SystemExit(f"no {system} run on row {key}")
    return runs[0]


def folder(run: paper.Run, seed: int, order: str) -> Path:
    return RUNS / f"{run.config}-{run.system}-s{seed}-{order}"


def reorder(workload: Workload, run: paper.Run, seed: int, order: str) -> Workload:
    if order == "dataset":
        return workload
    if order == "previous":
        seconds = previous_lengths(folder(run, seed, "dataset")).seconds
    else:  # each agent's own serial chain in the trace: what no run knows beforehand
        totals = _totals(workload, CostModel(sim_deployment(run.deployment)))
        seconds = {a.id: c for a, c in zip(workload.agents, totals.chains, strict=True)}
    return dataclasses.replace(
        workload, agents=longest_first(workload.agents, seconds, lambda a: a.id)
    )


def execute(job: tuple[paper.Run, int, str]) -> dict[str, Any]:
    run, seed, order = job
    workload = reorder(synthetic(run.workload, seed=seed), run, seed, order)
    out = folder(run, seed, order)
    policy = make_policy(paper.policy_spec(run))
    r = simulate(workload, run.deployment, policy, out, label=run.system, **paper.sim_settings(run))
    work = sorted(r.work.items())
    cli = paper.cli_args(run, seed)
    cli = cli if order == "dataset" else [*cli, "--order-from", str(folder(run, seed, "dataset"))]
    print(f"  {out.name:44s} {r.sim_seconds:9.1f} sim s  ({r.wall_seconds:.1f} s wall)", flush=True)
    return {
        "row": run.config,
        "system": run.system,
        "seed": seed,
        "order": order,
        "sim_seconds": r.sim_seconds,
        "work_digest": hashlib.sha256(json.dumps(work).encode()).hexdigest()[:16],
        "recompute_seconds": r.to_json()["engine"]["seconds_prefill_recompute"],
        "cli": None if order == "clairvoyant" else "python run.py " + shlex.join(cli),
    }


def report(records: list[dict[str, Any]], systems: list[str], seeds: list[int], wall: float) -> str:
    by = {(r["row"], r["system"], r["seed"], r["order"]): r for r in records}
    titles = rows()
    out = ["# A second pass, the longest tasks first (`--order-from`)", ""]
    out.append(
        f"Generated by `python bench/order.py` ({len(records)} simulated runs, {wall:,.0f} s of "
        "wall time). Pass 1: the dataset's order (the runs bench/paper.py and bench/stress.py "
        "record); pass 2: the same tasks ordered longest first by pass 1's generating and tool "
        "seconds (`run.py --order-from`); clairvoyant: by each agent's own chain in the trace, "
        f"for {systems[0]} only, which no run knows. Assumption: the simulator's second pass "
        "has the same trace (the bench script's docstring). Simulated seconds."
    )
    out += ["", "| row | seed | bound s | system | pass 1 s | pass 2 s | pass 2 / pass 1 | "
            "pass 2 / bound | clairvoyant s |", "|---" * 9 + "|"]  # fmt: skip
    problems: list[str] = []
    for key, (title, dep, wl) in titles.items():
        for seed in seeds:
            bound = lower_bound(synthetic(wl, seed=seed), dep)["bound_seconds"]
            for system in systems:
                one, two = (by.get((key, system, seed, o)) for o in ORDERS[:2])
                if one is None or two is None:
                    continue
                seer = by.get((key, system, seed, "clairvoyant"))
                for r in (two, seer):
                    if r and r["work_digest"] != one["work_digest"]:
                        problems.append(f"{key} {system} seed {seed} {r['order']}: other work")
                for r in (one, two, seer):
                    if r and r["sim_seconds"] < bound:
                        problems.append(f"{key} {system} seed {seed} {r['order']} below bound")
                a, b = one["sim_seconds"], two["sim_seconds"]
                c = f"{seer['sim_seconds']:,.0f}" if seer else "-"
                out.append(
                    f"| {title} | {seed} | {bound:,.0f} | {system} | {a:,.0f} | {b:,.0f} | "
                    f"{b / a:.3f} | {b / bound:.2f} | {c} |"
                )
    out += ["", "Checks: " + ("; ".join(problems) if problems else "the same work in every "
            "order; no run below its bound.")]  # fmt: skip
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description="a second pass ordered by the first (--order-from)")
    p.add_argument("--rows", help="comma-separated row keys (default all): " + ", ".join(rows()))
    p.add_argument("--systems", default="wset2,aimd", help="bench systems, comma-separated")
    p.add_argument("--seeds", default="0", help="comma-separated workload seeds")
    p.add_argument("--jobs", type=int, default=max(1, min(2, mp.cpu_count())))
    p.add_argument("--out", default="order", help="results name under bench/results/")
    a = p.parse_args()
    keys = a.rows.split(",") if a.rows else list(rows())
    systems, seeds = a.systems.split(","), [int(s) for s in a.seeds.split(",")]
    unknown = [k for k in keys if k not in rows()]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(rows())}")
    runs = [(bench_run(k, s), sd) for k in keys for s in systems for sd in seeds]
    start = time.monotonic()
    with mp.get_context("fork").Pool(a.jobs) as pool:
        records = pool.map(execute, [(r, sd, "dataset") for r, sd in runs], chunksize=1)
        later = [(r, sd, "previous") for r, sd in runs]
        later += [(r, sd, "clairvoyant") for r, sd in runs if r.system == systems[0]]
        records += pool.map(execute, later, chunksize=1)
    wall = time.monotonic() - start
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(records, indent=1) + "\n")
    text = report(records, systems, seeds, wall)
    (RESULTS / f"{a.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
