"""The gate's own cost with 10,000 agents, next to the engine's per-step time.

    python -m bench.gate_bench [--agents 10000] [--repeats 3] [--baseline REF] [--no-engine]
                               [--out gate.json]

Prints microseconds (this thread's CPU time) per admission check (the hot path: an admitted
agent between steps), per admission of a waiting agent, per pause/resume cycle, and per
control update (signals -> policy -> resize -> control line; aimd, wset, and wset2 with
holders in long tool calls, and wset2 with ~900 holders past the drop time every period;
the mean over 200 periods, which counts the few that move thousands of agents, and the
median; and the agents a period moves), and writes
bench/results/gate/gate.json (or --out there), with each figure's fastest and slowest
repeat. Each repeat runs in a fresh process; with --baseline, the `runner` package of a git
ref (e.g. main) is measured too, interleaved with this one (which goes first alternating), so
both see the same machine load. The wset2 scenarios: bench/common/gate_scenarios.py; the
baseline's process: bench/common/baseline.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import baseline
from bench.common.gate_scenarios import (
    cpu,
    moved_agents,
    named,
    signals_with,
    timed_periods,
    wset2_dropping_periods,
    wset2_periods,
)
from bench.common.paths import GATE_RESULTS, ROOT
from runner.engines.protocol import CacheStats, SamplingParams
from runner.gate.control import Controller
from runner.gate.gate import Gate
from runner.policies.aimd import AIMD
from runner.policies.experimental.wset import WorkingSet
from runner.sim.engine import CostModel
from runner.sim.engine import deployment as sim_deployment

RESULTS = GATE_RESULTS
# the per-period figures set against one engine step
PERIODS = (
    "control_update_us",
    "control_update_median_us",
    "control_update_wset_us",
    "control_update_wset_moving_us",
    "control_update_wset_moving_median_us",
    "wset_policy_update_us",
    "control_update_wset2_tools_us",
    "control_update_wset2_tools_median_us",
    "wset2_policy_update_us",
    "control_update_wset2_dropping_us",
    "control_update_wset2_dropping_median_us",
)


async def _half_held(n: int) -> tuple[Gate, list[asyncio.Task[None]], list[str]]:
    """A gate of n agents with random contexts (each above the ~1,000 shared tokens the
    periods report): half hold a slot, half wait (pending)."""
    rng = random.Random(0)
    keys = [f"agent-{i}" for i in range(n)]
    gate = Gate(n // 2, pause_rule="newest", resume_rule="newest")
    for k in keys:
        gate.register(k)
    tasks = [asyncio.create_task(gate.acquire(k, rng.randint(2_000, 30_000))) for k in keys]
    await asyncio.sleep(0)
    return gate, tasks, keys


async def wset_periods(n: int, periods: int) -> dict[str, float]:
    """wset's own update, and whole wset periods on a gate that moves: between two periods,
    agents take steps (contexts grow, the hot path), first requests report the shared prefix,
    the fit shrinks, agents are marked and pause at their next step."""
    gate, tasks, keys = await _half_held(n)
    kw = dict(
        now=0.0, window=n // 2, usage=0.3, hit_rate=0.5, active=n // 2, paused=0,
        pending=n - n // 2, finished=0, unfinished=n, capacity_tokens=n * 20_000,
        growth_per_step=500.0, recompute_rate=0.1, shared_tokens=1_000,
    )  # fmt: skip
    sig = signals_with(gate, **kw)
    policy = WorkingSet()
    t = cpu()
    for _ in range(periods):
        policy.update(sig)
    policy_us = (cpu() - t) / periods * 1e6

    rng = random.Random(1)
    ctx = dict.fromkeys(keys, 15_000)
    held_tokens = 15_500 * (n // 2)  # the pool fits about the holders: the fit moves each period
    ctl = Controller(gate, WorkingSet(), lambda: CacheStats(0.3, int(held_tokens / 0.9)), 1.0)
    stepping: dict[str, asyncio.Task[None]] = {}
    spent, moved = [], 0
    for p in range(periods):
        for k in rng.sample(keys[: n // 2], 200):  # 200 steps a period among the first holders
            if k not in stepping or stepping[k].done():
                ctx[k] += rng.randint(50, 400)
                stepping[k] = asyncio.create_task(gate.acquire(k, ctx[k]))
        await asyncio.sleep(0)
        for i in range(10):  # first requests: what they found cached is the shared prefix
            ctl.record(3_000, 1_000 + (p * 10 + i) % 7, 3_000)
        ctl.record(20_000, 15_000)
        t = cpu()
        ctl.step()
        spent.append(cpu() - t)
        moved += moved_agents(ctl.stats.last)  # the agents it marked, paused, resumed, admitted
        await asyncio.sleep(0)
    for task in [*tasks, *stepping.values()]:
        task.cancel()
    await asyncio.gather(*tasks, *stepping.values(), return_exceptions=True)
    return {
        "wset_policy_update_us": policy_us,
        **named("control_update_wset_moving", spent),
        "control_update_wset_moving_agents_per_period": moved / periods,
    }


async def gate_costs(n: int) -> dict[str, float]:
    keys = [f"agent-{i}" for i in range(n)]
    gate = Gate(n)
    for k in keys:
        gate.register(k)

    # admission of waiting agents: n agents each acquire once with room for all
    t = cpu()
    for k in keys:
        await gate.acquire(k, 1000)
    admit_us = (cpu() - t) / n * 1e6

    # the hot path: an admitted agent's check before its next generation
    reps = 20
    t = cpu()
    for r in range(reps):
        for k in keys:
            await gate.acquire(k, 1000 + r)
    hot_us = (cpu() - t) / (n * reps) * 1e6

    # control updates: AIMD over the full population, window moving every period
    usage = [0.1, 0.3, 0.7, 0.7]  # grow, hold, cut (with low H), cut
    ctl = Controller(gate, AIMD(), lambda: CacheStats(usage[ctl.stats.periods % 4]), 1.0)
    periods = 200
    control, control_moved = timed_periods(ctl, periods, lambda: ctl.record(1000, 100))

    # the same with wset, which reads every agent's context each period
    ws = Controller(gate, WorkingSet(), lambda: CacheStats(0.3, 10_000_000), 1.0)
    control_wset, _ = timed_periods(ws, periods, lambda: ws.record(1000, 100))

    # pause + resume cycle: shrink to half (marks n/2), they reach a boundary and wait,
    # then grow back (resumes n/2)
    gate.resize(n)
    await asyncio.sleep(0)
    half = n // 2
    t = cpu()
    gate.resize(half)
    waiters = [asyncio.create_task(gate.acquire(k, 1000)) for k in keys]
    await asyncio.sleep(0)
    gate.resize(n)
    await asyncio.gather(*waiters)
    cycle_us = (cpu() - t) / half * 1e6
    assert gate.counters.resumes >= half

    t = cpu()
    for k in keys:
        gate.finish(k)
    finish_us = (cpu() - t) / n * 1e6
    return {
        "admission_check_hot_us": hot_us,
        "admit_waiting_agent_us": admit_us,
        "pause_resume_cycle_us_per_agent": cycle_us,
        **named("control_update", control),
        "control_update_agents_per_period": control_moved,
        **named("control_update_wset", control_wset),
        **await wset_periods(n, periods),
        **await wset2_periods(n, periods),
        **await wset2_dropping_periods(n, periods),
        "finish_us": finish_us,
    }


async def engine_step_seconds() -> dict[str, float] | None:
    try:
        from runner.engines.llama_cpp import LlamaCppEngine

        eng = LlamaCppEngine(n_ctx=4096, pool_tokens=8192, max_seqs=4)
    except Exception as e:  # the CPU engine is optional for this benchmark
        print(f"(engine step not measured: {e})")
        return None
    tok = eng.tokenizer
    ids = tok.encode(tok.render([{"role": "user", "content": "Count to ten. " * 60}]))
    sp = SamplingParams(max_new_tokens=64, temperature=0.0)
    cold = await eng.generate(ids, sp)
    warm = await eng.generate(ids, sp)
    await eng.aclose()
    return {
        "prompt_tokens": cold.prompt_tokens,
        "cold_step_s": cold.seconds,
        "warm_step_s": warm.seconds,
        "completion_tokens": warm.completion_tokens,
    }


def deployment_steps() -> dict[str, float]:
    """One engine step of the deployments the gate runs against (the simulator's cost model,
    docs/simulator.md): the cheapest decode (one request, 1K context) and a mid-run decode
    (64 requests at 16K each), in microseconds."""
    out = {}
    for name in ("qwen3-32b-tp8", "qwen3-32b-tp2", "deepseek-v3-tp16"):
        cost = CostModel(sim_deployment(name))
        out[f"{name}_decode_1x1k_us"] = cost.decode(1, 1_000) * 1e6
        out[f"{name}_decode_64x16k_us"] = cost.decode(64, 64 * 16_000) * 1e6
    return out


def measure(code: Path, agents: int) -> dict[str, float]:
    """One run of gate_costs in a fresh process, importing `runner` from `code`."""
    argv = [sys.executable, "-m", "bench.gate_bench", "--child", "--agents", str(agents)]
    out = subprocess.run(argv, **baseline.child(code), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="also measure the gate at this git ref, interleaved with this code (same load)",
    )
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--out", default="gate.json", help="file name under bench/results/gate/")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        baseline.check_runner()
        print(json.dumps(asyncio.run(gate_costs(args.agents))))
        return
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"current": ROOT}
        if args.baseline:
            sides["baseline"] = baseline.baseline_code(args.baseline, Path(tmp))
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for r in range(args.repeats):  # interleaved: both sides see the same load
            # which side runs first alternates: the second of a pair read up to ~10% faster
            # (this code against itself)
            for side, code in list(sides.items())[:: -1 if r % 2 else 1]:
                runs[side].append(measure(code, args.agents))
    med = {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()
    }
    # the fastest and the slowest repeat of each figure: how much the machine's load moved it
    spread = {
        side: {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k in rs[0]}
        for side, rs in runs.items()
    }
    gate = med["current"]
    engine = None if args.no_engine else asyncio.run(engine_step_seconds())
    steps = deployment_steps()
    fastest = min(steps.values())
    mid = steps["qwen3-32b-tp8_decode_64x16k_us"]
    print(f"gate with {args.agents} agents (median of {args.repeats} runs, one process each):")
    base = med.get("baseline")
    for k, v in gate.items():
        unit = "us" if "_us" in k else "  "
        before = (
            f"   before {base[k]:10.2f} {unit} ({base[k] / v:5.1f}x)" if k in (base or {}) else ""
        )
        print(f"  {k:44s} {v:10.2f} {unit}{before}")
    if engine:
        warm_us = engine["warm_step_s"] * 1e6
        print(
            f"engine step, SmolLM2-135M on this CPU: cold {engine['cold_step_s']:.3f} s, "
            f"warm {engine['warm_step_s']:.3f} s ({engine['prompt_tokens']} prompt tokens, "
            f"{engine['completion_tokens']} generated)"
        )
        print(
            f"  hot admission check = {gate['admission_check_hot_us'] / warm_us:.2e} of a "
            f"warm engine step; control update = {gate['control_update_us'] / warm_us:.2e}"
        )
    print(
        f"one engine step of the simulated deployments: {fastest:.0f} us at the fastest "
        f"(Qwen TP8, 1 request at 1K), {mid:.0f} us mid-run (64 requests at 16K)"
    )
    mids = {k.removesuffix("_decode_64x16k_us"): v for k, v in steps.items() if "64x16k" in k}
    shares = {}
    for k in PERIODS:
        shares[k] = {
            "fastest_step": gate[k] / fastest,
            "mid_run_step": gate[k] / mid,  # Qwen TP8's: the shortest mid-run step of them
            "mid_run_step_by_deployment": {name: gate[k] / us for name, us in mids.items()},
        }
        print(f"  {k:44s} = {gate[k] / fastest:.2%} of the fastest, {gate[k] / mid:.2%} mid-run")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.out
    record = {
        "agents": args.agents,
        "repeats": args.repeats,
        "gate_us": gate,
        "gate_us_spread": spread["current"],  # [fastest, slowest] repeat
        **(
            {"baseline": {"ref": args.baseline, "gate_us": base, "spread": spread["baseline"]}}
            if base
            else {}
        ),
        "engine": engine,
        "deployment_step_us": steps,
        "share_of_step": shares,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        # other work on the machine inflates every figure; before and after the measurements
        "load_average_1min": [load_before[0], os.getloadavg()[0]],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
