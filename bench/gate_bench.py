"""The gate's own cost with 10,000 agents, next to the engine's per-step time.

    python bench/gate_bench.py [--agents 10000] [--no-engine]

Prints microseconds per admission check (the hot path: an admitted agent between steps),
per admission of a waiting agent, per pause/resume cycle, and per control update
(signals -> policy -> resize -> control line), and writes bench/results/gate.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.control import Controller
from runner.engine import CacheStats, SamplingParams
from runner.gate import Gate
from runner.policies import AIMD, Signals, WorkingSet
from runner.sim.engine import CostModel
from runner.sim.engine import deployment as sim_deployment

RESULTS = Path(__file__).resolve().parent / "results"


async def gate_costs(n: int) -> dict[str, float]:
    keys = [f"agent-{i}" for i in range(n)]
    gate = Gate(n)
    for k in keys:
        gate.register(k)

    # admission of waiting agents: n agents each acquire once with room for all
    t = time.perf_counter()
    for k in keys:
        await gate.acquire(k, 1000)
    admit_us = (time.perf_counter() - t) / n * 1e6

    # the hot path: an admitted agent's check before its next generation
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        for k in keys:
            await gate.acquire(k, 1000)
    hot_us = (time.perf_counter() - t) / (n * reps) * 1e6

    # control updates: AIMD over the full population, window moving every period
    usage = [0.1, 0.3, 0.7, 0.7]  # grow, hold, cut (with low H), cut
    ctl = Controller(gate, AIMD(), lambda: CacheStats(usage[ctl.stats.periods % 4]), 1.0)
    periods = 200
    t = time.perf_counter()
    for _ in range(periods):
        ctl.record(1000, 100)
        ctl.step()
    control_us = (time.perf_counter() - t) / periods * 1e6

    # the same with wset, which reads every agent's context each period (O(n log n))
    ws = Controller(gate, WorkingSet(), lambda: CacheStats(0.3, 10_000_000), 1.0)
    t = time.perf_counter()
    for _ in range(periods):
        ws.record(1000, 100)
        ws.step()
    control_wset_us = (time.perf_counter() - t) / periods * 1e6

    # wset's own update (the policy, given the signals), at n agents half held, half waiting
    rng = random.Random(0)
    half_n = n // 2
    sig = Signals(
        now=0.0, window=half_n, usage=0.3, hit_rate=0.5, active=half_n, paused=0,
        pending=n - half_n, finished=0, unfinished=n, capacity_tokens=n * 20_000,
        held_contexts=tuple(rng.randint(1_000, 30_000) for _ in range(half_n)),
        waiting_contexts=tuple(rng.randint(1_000, 30_000) for _ in range(n - half_n)),
        growth_per_step=500.0, recompute_rate=0.1, shared_tokens=1_000,
    )  # fmt: skip
    policy = WorkingSet()
    t = time.perf_counter()
    for _ in range(periods):
        policy.update(sig)
    wset_policy_us = (time.perf_counter() - t) / periods * 1e6

    # pause + resume cycle: shrink to half (marks n/2), they reach a boundary and wait,
    # then grow back (resumes n/2)
    gate.resize(n)
    await asyncio.sleep(0)
    half = n // 2
    t = time.perf_counter()
    gate.resize(half)
    waiters = [asyncio.create_task(gate.acquire(k, 1000)) for k in keys]
    await asyncio.sleep(0)
    gate.resize(n)
    await asyncio.gather(*waiters)
    cycle_us = (time.perf_counter() - t) / half * 1e6
    assert gate.counters.resumes >= half

    t = time.perf_counter()
    for k in keys:
        gate.finish(k)
    finish_us = (time.perf_counter() - t) / n * 1e6
    return {
        "admission_check_hot_us": hot_us,
        "admit_waiting_agent_us": admit_us,
        "pause_resume_cycle_us_per_agent": cycle_us,
        "control_update_us": control_us,
        "control_update_wset_us": control_wset_us,
        "wset_policy_update_us": wset_policy_us,
        "finish_us": finish_us,
    }


async def engine_step_seconds() -> dict[str, float] | None:
    try:
        from runner.engines.llama_cpp import LlamaCppEngine

        eng = LlamaCppEngine(n_ctx=4096)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-engine", action="store_true")
    args = p.parse_args()
    runs = [asyncio.run(gate_costs(args.agents)) for _ in range(args.repeats)]
    gate = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    engine = None if args.no_engine else asyncio.run(engine_step_seconds())
    print(f"gate with {args.agents} agents (median of {args.repeats} runs):")
    for k, v in gate.items():
        print(f"  {k:36s} {v:10.2f} us")
    if engine:
        warm_us = engine["warm_step_s"] * 1e6
        print(
            f"engine step, SmolLM2-135M on this CPU: cold {engine['cold_step_s']:.3f} s, "
            f"warm {engine['warm_step_s']:.3f} s ({engine['prompt_tokens']} prompt tokens, "
            f"{engine['completion_tokens']} generated)"
        )
        print(
            f"  hot admission check = {gate['admission_check_hot_us'] / warm_us:.2e} of a "
            f"warm engine step; control update = "
            f"{gate['control_update_us'] / warm_us:.2e} of one"
        )
    steps = deployment_steps()
    fastest = min(steps.values())
    print(f"one engine step of the simulated deployments: {fastest:.0f} us at the fastest")
    for k in ("control_update_wset_us", "wset_policy_update_us", "control_update_us"):
        print(f"  {k:36s} = {gate[k] / fastest:.2%} of the fastest step")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "gate.json"
    out.write_text(
        json.dumps(
            {
                "agents": args.agents,
                "repeats": args.repeats,
                "gate_us": gate,
                "engine": engine,
                "deployment_step_us": steps,
                "share_of_fastest_step": {
                    k: gate[k] / fastest
                    for k in (
                        "control_update_us",
                        "control_update_wset_us",
                        "wset_policy_update_us",
                    )
                },
                "python": platform.python_version(),
                "machine": platform.machine(),
                "load_average_1min": os.getloadavg()[0],  # other work on the machine inflates us
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
