"""Where each bench row's time goes beyond its oracle lower bound, from recorded engine counters.

    python -m bench.bound_gap      # reads bench/results/paper/paper.json, stress/stress.json

For the candidate policy's run (and the fastest run with a host tier) of every row: its
prefill seconds (fresh + recomputed), decode seconds and iterations, host loads and idle time,
each beside the bound's own figure (runner/sim/oracle.py: the batched prefill, the decode floor
and the least number of decode iterations it proves). The decode iterations beyond the bound's,
times one iteration's fixed cost (weights, launch, all-reduce latency), is the part of the gap
that comes from small decode batches. For chain-bound rows it also shows the longest agent's
tool seconds against the other agents' prefill: work that cannot ride in that agent's decode
iterations and has to run during its tools or stall it. Writes
bench/results/bound-gap/bound_gap.md.

    python -m bench.bound_gap --unbounded   # also simulates each row's candidate run again

`--unbounded` reruns the candidate on every row with a GPU memory so large that the KV pool
holds every agent's whole context at once (nothing is ever evicted; same cost model, same
settings otherwise), and writes bench/results/bound-gap/bound_gap-unbounded.json; the report
then splits each row's gap into the part the pool causes (device run against the unbounded
run) and the part that remains without any memory limit (the unbounded run against its own
bound).

    python -m bench.bound_gap --pool        # also simulates each row's candidate run again

`--pool` reruns the candidate on its own pool and writes
bench/results/bound-gap/bound_gap-pool.json; the report then shows where the pool's
token-seconds went (the simulator's `kv_token_seconds_*`): KV locked by running requests
during decode and during prefill iterations, cached but unlocked, and free, each over the
pool's capacity (so in seconds, adding up to the run's), and the run's tail (from the last
control period with an agent waiting at the gate to the end: the pool is no longer full)
with the mean KV usage before it and in it; beside it the unbounded run's token-seconds
(`--unbounded`) over the same device capacity: what the schedule would hold with nothing
evicted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from bench.common import paper_runs, stress_runs
from bench.common.paths import BOUND_GAP_RESULTS, PAPER_RESULTS, STRESS_RESULTS, STRESS_RUNS
from bench.common.rows import every_row, host_run
from runner.policies.registry import make_policy
from runner.sim.engine import CostModel
from runner.sim.engine import deployment as sim_deployment
from runner.sim.oracle import longest_prompt, lower_bound, lower_bounds, totals
from runner.sim.simulate import simulate
from runner.sim.workload import Workload, synthetic

RESULTS = BOUND_GAP_RESULTS
UNBOUNDED = RESULTS / "bound_gap-unbounded.json"
POOL = RESULTS / "bound_gap-pool.json"
# the reruns' folders: the stress suite's run folders, as ever (names end -unbounded, -pool)
RUNS = STRESS_RUNS
HOLDERS = ("decoding", "prefilling", "cached", "free")  # the simulator's kv_token_seconds_*
CANDIDATE = "wset2"


def _records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in (PAPER_RESULTS / "paper.json", STRESS_RESULTS / "stress.json"):
        if path.exists():
            out += json.loads(path.read_text())
    return out


def _riders(w: Workload, dep: str) -> tuple[float, float]:
    """(the longest agent's tool seconds, the others' prefill seconds at the bound's rate)."""
    cost = CostModel(sim_deployment(dep))
    tot = totals(w, cost)
    longest = max(range(len(tot.chains)), key=lambda a: tot.chains[a])
    tools = sum(t for t, _, _, a in tot.tools if a == longest)
    segs: list[tuple[int, int]] = []
    for a, ag in enumerate(w.agents):
        if a == longest:
            continue
        start, ctx = w.system_tokens, w.system_tokens + ag.prompt_tokens
        for s in ag.steps:
            segs.append((start, ctx))
            ctx += s.gen_tokens
            start, ctx = ctx, ctx + s.obs_tokens
    body = cost.prefill(segs).seconds - cost.prefill_fixed if segs else 0.0
    return tools, body


def _row(title: str, run: dict[str, Any] | None, b: dict[str, Any], fixed: float) -> str:
    if run is None:
        return f"| {title} | - |" + " - |" * 8
    e = run["engine"]
    prefill = e["seconds_prefill_new"] + e["seconds_prefill_recompute"]
    extra_iters = e["decode_iterations"] - b["decode_iterations_min"]
    cells = [
        f"{title}: {run['system']}",
        f"{run['sim_seconds']:,.0f} / {b['bound_seconds']:,.0f}",
        f"{prefill:,.0f} / {b['prefill_seconds']:,.0f}",
        f"{e['seconds_prefill_recompute']:,.0f}",
        f"{e['seconds_decode']:,.0f} / {b['decode_seconds']:,.0f}",
        f"{e['decode_iterations']:,} / {b['decode_iterations_min']:,}",
        f"{e['tokens_decode'] / max(1, e['decode_iterations']):.0f}",
        f"{extra_iters * fixed:,.0f}",
        f"{e['seconds_host_load']:,.0f} / {e['seconds_idle']:,.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _unbounded_gpu(w: Workload, dep: str) -> dict[str, Any]:
    """Deployment changes whose KV pool holds every agent's whole context (its template
    tokens included) at once: a larger GPU memory, and no --max-total-tokens cap. The cost
    model reads memory only for the pool's size, so every iteration costs what it did."""
    d = sim_deployment(dep)
    need = sum(longest_prompt(w, a) for a in range(len(w.agents)))
    rest = need * d.kv_bytes_per_token_per_gpu + d.weight_bytes_per_gpu
    memory = rest / d.mem_fraction_static + d.runtime_reserved_bytes
    gpu = dataclasses.replace(d.gpu, memory_bytes=max(d.gpu.memory_bytes, math.ceil(memory)))
    return {"gpu": gpu, "max_total_tokens": None}


def _candidate_runs() -> list[paper_runs.Run]:
    runs = [r for r in paper_runs.plan(None, quick=True) if r.system == CANDIDATE]
    return runs + stress_runs.plan(None, [CANDIDATE])


def simulate_unbounded() -> list[dict[str, Any]]:
    """The candidate on every row with a pool that never fills (_unbounded_gpu)."""
    out = []
    for run in _candidate_runs():
        w = synthetic(run.workload, seed=0)
        changes = _unbounded_gpu(w, run.deployment)
        settings = paper_runs.sim_settings(run)
        settings["engine_options"] = {**settings["engine_options"], **changes}
        dest = RUNS / f"{run.name}-unbounded"
        r = simulate(w, run.deployment, make_policy(paper_runs.policy_spec(run)), dest,
                     label=run.system, **settings)  # fmt: skip
        e = r.to_json()["engine"]
        bound = lower_bound(w, run.deployment, **changes)["bound_seconds"]
        out.append({"config": run.config, "system": run.system, "sim_seconds": r.sim_seconds,
                    "bound_seconds": bound, "capacity_tokens": e["capacity_tokens"],
                    "evicted_tokens": e["evicted_tokens"], "engine": e})  # fmt: skip
        print(f"  {run.name:28s} unbounded pool {e['capacity_tokens']:,} tokens: "
              f"{r.sim_seconds:,.1f} s (bound {bound:,.1f})", flush=True)  # fmt: skip
    return out


def _logging(policy: Any, log: list[tuple[float, float]]) -> Any:
    """The same policy, deciding the same, that also appends (period's time, slot holders'
    contexts / pool) to `log` each period: the gate's view it is handed (`Signals.contexts`,
    each holder's whole context, a shared prompt counted once per holder)."""
    base = type(policy)

    class Logged(base):  # type: ignore[misc, valid-type]
        def update(self, s: Any) -> Any:
            if s.capacity_tokens:
                log.append((s.now, s.contexts.total(s.contexts.held) / s.capacity_tokens))
            return super().update(s)

    return Logged(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


def simulate_pool() -> list[dict[str, Any]]:
    """The candidate on every row on its own pool, for the pool's token-seconds."""
    out = []
    for run in _candidate_runs():
        w = synthetic(run.workload, seed=0)
        dest = RUNS / f"{run.name}-pool"
        held: list[tuple[float, float]] = []
        policy = _logging(make_policy(paper_runs.policy_spec(run)), held)
        r = simulate(w, run.deployment, policy, dest, label=run.system,
                     **paper_runs.sim_settings(run))  # fmt: skip
        e = r.to_json()["engine"]
        lines = [json.loads(x) for x in (dest / "control.jsonl").read_text().splitlines()]
        tail = _tail(lines, r.sim_seconds)
        last = r.sim_seconds - tail["tail_seconds"]
        mid = [x for t, x in held if 30.0 <= t <= last]
        ws = sum(mid) / len(mid) if mid else None
        out.append({"config": run.config, "system": run.system, "sim_seconds": r.sim_seconds,
                    "engine": e, **tail, "holders_of_pool_before_tail": ws})  # fmt: skip
        print(f"  {run.name:28s} {r.sim_seconds:,.1f} s", flush=True)
    return out


def _tail(lines: list[dict[str, Any]], seconds: float) -> dict[str, float | None]:
    """The tail of a run, from its control lines: from the last period with an agent waiting
    at the gate (paused or pending) to the end, and the mean KV usage U before and in it
    (None: no period; a run where no agent waits after the start is all tail)."""
    last = max((x["t"] for x in lines if x["paused"] + x["pending"] > 0), default=0.0)
    before = [x["u"] for x in lines if last > 0 and x["t"] <= last]
    after = [x["u"] for x in lines if x["t"] > last]
    return {
        "tail_seconds": seconds - last,
        "u_before_tail": sum(before) / len(before) if before else None,
        "u_in_tail": sum(after) / len(after) if after else None,
    }


def _held(e: dict[str, Any], capacity: int) -> list[float]:
    """The run's pool token-seconds by holder over `capacity`."""
    return [e[f"kv_token_seconds_{k}"] / capacity for k in HOLDERS]


def _pool_table(
    pool: list[dict[str, Any]],
    unbounded: list[dict[str, Any]] | None,
    rows: dict[str, tuple[str, Workload, str, float]],
) -> list[str]:
    """Where each row's pool token-seconds went, on the device and with nothing evicted."""
    free_of = {u["config"]: u for u in unbounded or []}
    out = ["", f"## Where {CANDIDATE}'s pool token-seconds go", ""]
    out += ["`python -m bench.bound_gap --pool`: the candidate's run again on its own pool, "
            "its KV pool's token-seconds split by what held them (the simulator's "
            "`kv_token_seconds_*`), each over the pool's capacity: seconds of the whole pool, "
            "adding up to the run's seconds. `decoding`: KV locked by the running requests "
            "during decode iterations (the shared prompt once); `prefilling`: locked during "
            "prefill iterations (the running requests waiting, and the batch's allocated "
            "prompts); `cached`: unlocked, evictable (agents in tools or paused, finished "
            "agents, the shared prompt between requests); `free`. `tail`: from the last "
            "control period with an agent waiting at the gate (paused or pending) to the end, "
            "where the agents left no longer fill the pool; `U`: the engine's KV usage (locked "
            "share) averaged over the control periods before and in it; `holders' contexts`: "
            "the slot holders' contexts (the gate's view the policy is handed, a shared prompt "
            "counted once per holder) over the pool, averaged from t = 30 s to the tail. The "
            "unbounded run "
            "(`--unbounded`) is the same schedule's need with nothing ever evicted, over the "
            "same device capacity: more than its seconds where the device pool could not hold "
            "it.", ""]  # fmt: skip
    out += ["| row | run s / bound | decoding | prefilling | cached | free | tail s (share) | "
            "U before / in the tail | holders' contexts / pool before it | unbounded run s | "
            "its decoding / prefilling / cached |", "|---" * 11 + "|"]  # fmt: skip
    for d in pool:
        title, _, _, b = rows[d["config"]]
        cap = d["engine"]["capacity_tokens"]
        held = _held(d["engine"], cap)
        u = free_of.get(d["config"])
        uh = _held(u["engine"], cap) if u else None
        need = " / ".join(f"{x:,.0f}" for x in uh[:3]) if uh else "-"
        cells = [f"{x:,.0f} ({x / d['sim_seconds']:.0%})" for x in held]
        cells.append(f"{d['tail_seconds']:,.0f} ({d['tail_seconds'] / d['sim_seconds']:.0%})")
        shares = (d["u_before_tail"], d["u_in_tail"], d["holders_of_pool_before_tail"])
        ratios = [f"{x:.2f}" if x is not None else "-" for x in shares]
        cells += [" / ".join(ratios[:2]), ratios[2]]
        tail = f"{u['sim_seconds']:,.0f} | {need}" if u else "- | -"
        run = f"{d['sim_seconds']:,.0f} / {b:,.0f}"
        out.append(f"| {title} | {run} | {' | '.join(cells)} | {tail} |")
    return out


def _unbounded_table(
    records: list[dict[str, Any]],
    unbounded: list[dict[str, Any]],
    rows: dict[str, tuple[str, Workload, str, float]],
) -> list[str]:
    """Each row's candidate on its pool and on a pool that never fills, against each bound.
    `rows`: key -> (title, workload, deployment, device bound), as report() computed them."""
    device: dict[str, dict[str, Any]] = {}
    for r in records:  # the first, as report() takes it (paper.json and stress.json first)
        if r["system"] == CANDIDATE:
            device.setdefault(r["config"], r)
    out = ["", f"## {CANDIDATE} with a pool that never fills", ""]
    out += ["`python -m bench.bound_gap --unbounded`: the same run on a GPU whose KV pool holds "
            "every context at once (nothing evicted), beside the device run. `pool part` is "
            "device run / unbounded run, `rest` the unbounded run / its own bound (the part no "
            "memory explains); their product times the unbounded bound / the device bound is "
            "the device run / its bound.", ""]  # fmt: skip
    out += ["| row | device run s / bound | unbounded pool, tokens | its run s / bound | pool "
            "part | rest | evicted |", "|---" * 7 + "|"]  # fmt: skip
    for u in unbounded:
        d = device.get(u["config"])
        if d is None:
            continue
        title, w, dep, b = rows[u["config"]]
        # recomputed, not read from the file: the bound may have been tightened since the runs
        u = {**u, "bound_seconds": lower_bound(w, dep, **_unbounded_gpu(w, dep))["bound_seconds"]}
        out.append(
            f"| {title} | {d['sim_seconds']:,.0f} / {b:,.0f} | "
            f"{u['capacity_tokens']:,} | {u['sim_seconds']:,.0f} / {u['bound_seconds']:,.0f} | "
            f"{d['sim_seconds'] / u['sim_seconds']:.2f} | "
            f"{u['sim_seconds'] / u['bound_seconds']:.2f} | {u['evicted_tokens']:,} |"
        )
    return out


def report(
    records: list[dict[str, Any]],
    unbounded: list[dict[str, Any]] | None = None,
    pool: list[dict[str, Any]] | None = None,
) -> str:
    by_row: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_row.setdefault(r["config"], []).append(r)
    out = ["# Where the time goes beyond the lower bound", ""]
    out += [
        "Generated by `python -m bench.bound_gap`. "
        + " ".join((__doc__ or "").split("\n\n")[2].split()),
        "",
    ]
    out += ["| row: run | s / bound | prefill s / bound's | of it recompute | decode s / "
            "bound's | decode iterations / bound's least | tokens per iteration | extra "
            "iterations x fixed cost, s | host load / idle s |", "|---" * 9 + "|"]  # fmt: skip
    chains = ["", "| chain-bound row | chain s | shared chain s | longest agent's tools s | "
              "others' prefill s |", "|---|---|---|---|---|"]  # fmt: skip
    rows: dict[str, tuple[str, Workload, str, float]] = {}
    for key, title, dep, wl in every_row():
        w = synthetic(wl, seed=0)
        b, bh = lower_bounds(w, dep)
        rows[key] = (title, w, dep, b["bound_seconds"])
        fixed = CostModel(sim_deployment(dep)).decode(1, 0)
        runs = by_row.get(key, [])
        cand = next((r for r in runs if r["system"] == CANDIDATE), None)
        hosts = [r for r in runs if host_run(r)]
        host = min(hosts, key=lambda r: r["sim_seconds"], default=None)
        out.append(_row(title, cand, b, fixed))
        out.append(_row(title, host, bh, fixed))
        if b["bound_seconds"] in (b["longest_chain_seconds"], b["shared_chain_seconds"]):
            tools, others = _riders(w, dep)
            chains.append(
                f"| {title} | {b['longest_chain_seconds']:,.0f} | "
                f"{b['shared_chain_seconds']:,.0f} | {tools:,.0f} | {others:,.0f} |"
            )
    extra = _unbounded_table(records, unbounded, rows) if unbounded else []
    extra += _pool_table(pool, unbounded, rows) if pool else []
    return "\n".join(out + chains + extra) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--unbounded",
        action="store_true",
        help="simulate each row's candidate again with a pool that never fills",
    )
    p.add_argument(
        "--pool",
        action="store_true",
        help="simulate each row's candidate again on its pool, for its token-seconds",
    )
    args = p.parse_args()
    records = _records()
    if not records:
        print(f"no results in {PAPER_RESULTS} or {STRESS_RESULTS}")
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.unbounded:
        UNBOUNDED.write_text(json.dumps(simulate_unbounded(), indent=1) + "\n")
    if args.pool:
        POOL.write_text(json.dumps(simulate_pool(), indent=1) + "\n")
    unbounded = json.loads(UNBOUNDED.read_text()) if UNBOUNDED.exists() else None
    pool = json.loads(POOL.read_text()) if POOL.exists() else None
    text = report(records, unbounded, pool)
    (RESULTS / "bound_gap.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
