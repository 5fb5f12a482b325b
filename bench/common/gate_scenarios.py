"""The gate's control periods at scale, as bench.gate_bench times them and bench.gate_count
counts them: the two wset2 scenarios both measure (holders in long tool calls; ~900 holders
past the drop time every period), and the helpers every gate scenario uses (thread CPU time,
the periods' figures, signals from a gate of this code or of a --baseline ref's).

Imports `runner` as the process found it: in a --baseline child, the ref's
(bench/common/baseline.py); the code paths for older refs are marked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from runner.engines.protocol import CacheStats
from runner.gate.control import Controller
from runner.gate.gate import Gate
from runner.policies.protocol import Signals

DROPPING_WARMUP = 90  # wset2_dropping_periods' untimed periods (bench.gate_count skips them)


def cpu() -> float:
    """This thread's CPU time: what the gate costs, without the time other processes on a
    shared machine take the core away (wall time on a loaded machine reads several x high)."""
    return time.thread_time()


def timed_periods(
    ctl: Controller, periods: int, before: Callable[[], None]
) -> tuple[list[float], float]:
    """Seconds of each of `periods` control steps (`before` runs untimed ahead of each), and
    the agents a period moved, on average (what the mean includes beyond the median)."""
    out, moved = [], 0
    for _ in range(periods):
        before()
        t = cpu()
        ctl.step()
        out.append(cpu() - t)
        moved += moved_agents(ctl.stats.last)
    return out, moved / periods


def moved_agents(line: dict[str, Any]) -> int:
    """The agents a period's control line admitted, marked or paused, and resumed."""
    return len(line["admitted"]) + len(line["paused_ids"]) + len(line["resumed"])


def named(name: str, seconds: list[float]) -> dict[str, float]:
    """The mean period (what a run pays on average) and the median one (a typical period;
    the mean includes the few that pause or resume thousands of agents at once)."""
    return {
        f"{name}_us": statistics.fmean(seconds) * 1e6,
        f"{name}_median_us": statistics.median(seconds) * 1e6,
    }


def signals_with(gate: Gate, **kw: object) -> Signals:
    """Signals carrying the gate's contexts: its view where the code has one
    (`Signals.contexts`), the two tuples of the code before it (a --baseline run)."""
    if "contexts" in {f.name for f in dataclasses.fields(Signals)}:
        return Signals(contexts=gate.contexts(), **kw)  # type: ignore[arg-type]
    held, waiting = gate.contexts()  # type: ignore[misc]  # the tuples of the code before
    return Signals(held_contexts=held, waiting_contexts=waiting, **kw)  # type: ignore[call-arg]


async def aimd_periods(n: int, periods: int) -> dict[str, float]:
    """The default policy's periods (`aimd`) on a gate of n agents, all admitted once, the
    window moving every period: grow, hold, cut with a low hit rate, cut (gate_bench's
    `control_update`)."""
    from runner.policies.aimd import AIMD

    keys = [f"agent-{i}" for i in range(n)]
    gate = Gate(n)
    for k in keys:
        gate.register(k)
    for k in keys:
        await gate.acquire(k, 1000)
    usage = [0.1, 0.3, 0.7, 0.7]
    ctl = Controller(gate, AIMD(), lambda: CacheStats(usage[ctl.stats.periods % 4]), 1.0)
    spent, moved = timed_periods(ctl, periods, lambda: ctl.record(1000, 100))
    return {**named("control_update_aimd", spent), "agents_per_period": moved}


async def wset2_periods(n: int, periods: int) -> dict[str, float]:
    """wset2 periods (its tool signals read from the gate, and KV of holders in long calls
    dropped from the fit) on a gate of n agents, half held, on a clock of its own: a fifth of
    the finished calls took a minute, the rest half a second; a fifth of the holders are in
    a call, and between two periods 100 of them come back (a step) and 100 others go into
    one, and the clock moves 1 s. The break-even is 20 s: a holder half a second into a call
    is in a long one, and its KV is dropped from the fit."""
    try:
        from runner.policies.wset2 import WorkingSet2
    except ImportError:  # a --baseline before wset2: nothing to measure
        return {}
    rng, now = random.Random(2), [0.0]
    keys = [f"agent-{i}" for i in range(n)]
    held = keys[: n // 2]
    gate = Gate(n // 2, pause_rule="newest", resume_rule="newest", clock=lambda: now[0])
    ctx = {k: rng.randint(2_000, 30_000) for k in keys}
    tasks = [asyncio.create_task(gate.acquire(k, ctx[k])) for k in keys]
    await asyncio.sleep(0)
    for i, k in enumerate(held[:1000]):  # the finished calls the policy sees
        gate.done_request(k)
        now[0] += 60.0 if i % 5 == 0 else 0.5
        await gate.acquire(k, ctx[k])
    in_tool = set(rng.sample(held, n // 10))  # a fifth of the holders
    for k in in_tool:
        gate.done_request(k)
    capacity = int(sum(ctx[k] + 500 for k in held) / 0.9)
    per_token = 20.0 / capacity  # the break-even: capacity x per_token = 20 s
    stats = CacheStats(0.3, capacity, recompute_token_seconds=per_token)
    ctl = Controller(gate, WorkingSet2(), lambda: stats, 1.0)
    spent, dropped, moved = [], 0, 0
    policy_s = 0.0
    stepping: list[asyncio.Task[None]] = []
    for _ in range(periods):
        back = rng.sample(sorted(in_tool), 100)
        for k in back:  # a step each; one a period marked pauses there (not awaited)
            ctx[k] += rng.randint(50, 400)
            stepping.append(asyncio.create_task(gate.acquire(k, ctx[k])))
        await asyncio.sleep(0)
        going = rng.sample([k for k in held if k not in in_tool], 100)
        for k in going:
            gate.done_request(k)
        in_tool = (in_tool - set(back)) | set(going)
        now[0] += 1.0
        ctl.record(3_000, 1_000, 3_000)
        t = cpu()
        ctl.step()
        spent.append(cpu() - t)
        moved += moved_agents(ctl.stats.last)
        tools, after = _tool_signals(gate, capacity * per_token)
        dropped += _dropped(tools, after)
        sig = signals_with(
            gate, now=now[0], window=n // 2, usage=0.3, hit_rate=0.5, active=n // 2, paused=0,
            pending=n - n // 2, finished=0, unfinished=n, capacity_tokens=capacity,
            growth_per_step=500.0, shared_tokens=1_000, recompute_token_seconds=per_token,
            **({"tools": tools} if hasattr(tools, "held_past") else tools),
        )  # fmt: skip
        t = cpu()
        WorkingSet2().update(sig)
        policy_s += cpu() - t
    for task in [*tasks, *stepping]:
        task.cancel()
    await asyncio.gather(*tasks, *stepping, return_exceptions=True)
    return {
        **named("control_update_wset2_tools", spent),
        "control_update_wset2_tools_agents_per_period": moved / periods,
        "wset2_policy_update_us": policy_s / periods * 1e6,
        "wset2_holders_dropped_per_period": dropped / periods,
    }


async def wset2_dropping_periods(
    n: int, periods: int, warmup: int = DROPPING_WARMUP
) -> dict[str, float]:
    """wset2 periods where hundreds of holders are past the drop time in every one, as in
    the stress suite's slow-tools row: a gate of n agents, half held at first, on a clock
    of its own; each 1-s period 150 holders go into a tool call at random instants, a tenth
    of the calls taking 30-90 s and the rest 0.1-1.5 s, and the calls due back return within
    the period (a step each, its context grown). The break-even is 20 s, so the drop time
    settles about 1.2 s into a call and the ~900 holders in long calls are past it. The
    first `warmup` periods (untimed) bring the calls in flight and the kept durations to
    that steady state; the timed periods follow."""
    try:
        from runner.policies.wset2 import WorkingSet2
    except ImportError:  # a --baseline before wset2: nothing to measure
        return {}
    rng, now = random.Random(3), [0.0]
    keys = [f"agent-{i}" for i in range(n)]
    gate = Gate(n // 2, pause_rule="newest", resume_rule="newest", clock=lambda: now[0])
    ctx = {k: rng.randint(2_000, 30_000) for k in keys}
    tasks = [asyncio.create_task(gate.acquire(k, ctx[k])) for k in keys]
    await asyncio.sleep(0)
    capacity = int(sum(ctx[k] + 500 for k in keys[: n // 2]) / 0.9)
    per_token = 20.0 / capacity  # the break-even: capacity x per_token = 20 s
    stats = CacheStats(0.3, capacity, recompute_token_seconds=per_token)
    ctl = Controller(gate, WorkingSet2(), lambda: stats, 1.0)
    back_at: dict[str, float] = {}  # the holders in a call: when it returns
    spent, dropped, moved = [], 0, 0
    for p in range(warmup + periods):
        for t, k, going in _call_events(rng, gate, keys, back_at, now[0]):
            now[0] = t
            if going:
                gate.done_request(k)
            else:  # a step, at once; a holder marked pauses there (not awaited)
                ctx[k] += rng.randint(50, 400)
                tasks.append(asyncio.create_task(gate.acquire(k, ctx[k])))
                await asyncio.sleep(0)
        now[0] = float(p + 1)
        await asyncio.sleep(0)
        ctl.record(3_000, 1_000, 3_000)
        t = cpu()
        ctl.step()
        if p < warmup:
            continue
        spent.append(cpu() - t)
        moved += moved_agents(ctl.stats.last)
        tools, after = _tool_signals(gate, capacity * per_token)
        dropped += _dropped(tools, after)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        **named("control_update_wset2_dropping", spent),
        "control_update_wset2_dropping_agents_per_period": moved / periods,
        "wset2_dropping_holders_dropped_per_period": dropped / periods,
    }


def _call_events(
    rng: random.Random, gate: Gate, keys: list[str], back_at: dict[str, float], start: float
) -> list[tuple[float, str, bool]]:
    """One period's tool-call events, (time, agent, going into a call), in time order: 150
    holders not in a call (picked at random) go into one at a random instant, to return
    after its duration, and every call due within [start, start + 1) returns (`back_at`
    updated)."""
    going: dict[str, float] = {}
    while len(going) < 150:  # rejection sampling: cheaper than listing the free holders
        k = keys[rng.randrange(len(keys))]
        if k not in back_at and k not in going and gate.state(k) == "active":
            going[k] = start + rng.random()
    for k, t in going.items():
        long = rng.random() < 0.1
        back_at[k] = t + (rng.uniform(30.0, 90.0) if long else rng.uniform(0.1, 1.5))
    events = [(t, k, True) for k, t in going.items()]
    events += [(t, k, False) for k, t in back_at.items() if t < start + 1.0]
    for _, k, going_in in events:
        if not going_in:
            del back_at[k]
    return sorted(events)


def _dropped(tools: Any, after: float) -> int:
    """How many holders wset2 drops at `after` seconds in a call (_tool_signals' view)."""
    if hasattr(tools, "held_past"):
        return len(tools.held_past(after))
    return sum(t > 0 and t >= after for t in tools["held_tool_seconds"])


def _tool_signals(gate: Gate, break_even: float) -> tuple[Any, float]:
    """The gate's tool signals and the time from which wset2 drops a holder's KV: its view
    where the code has one (`Gate.tools`), the tuples of the code before it (a --baseline
    run: `Signals.held_tool_seconds` and `tool_durations`)."""
    try:
        from runner.policies.wset2 import RemainingTime
    except ImportError:  # a --baseline ref from before the public name: only the private one
        from runner.policies.wset2 import _RemainingTime as RemainingTime

    if hasattr(gate, "tools"):
        view = gate.tools()
        return view, RemainingTime(view.durations()).first_above(break_even)
    held, durations = gate.tool_seconds(), gate.tool_durations()  # type: ignore[attr-defined]
    tuples = {"held_tool_seconds": held, "tool_durations": durations}
    return tuples, RemainingTime(durations).first_above(break_even)
