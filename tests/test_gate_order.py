"""The gate's incremental keep order (runner/gate_order.py) against the plain sort-based gate.

Thousands of random event sequences (agents asking with growing, shrinking or equal contexts,
requests ending, agents finishing or being cancelled while they wait, the window resized,
time moving or standing still) run through both gates; every decision (who is marked, paused,
unmarked, resumed, admitted, in which order), every state and count, the contexts a policy
reads (contexts, holders past a time in a tool call, tool durations), and `fit` / `total` on
them (one `fitter` for many budgets too) must be the same after every event. Blocks are made
tiny (1 and 4 agents) so that splits and merges happen all the time.
"""

import asyncio
import random

import pytest

from runner import gate_order
from runner.gate import PAUSE_RULES, RESUME_RULES, Gate
from runner.policies import ContextList, ToolList
from tests import reference_gate


def check_structure(gate: Gate) -> None:
    """Every block's running total and lower bound hold, keys are sorted, agents know their
    block, and the segments hold exactly the holders and the waiters."""
    seen = set()
    for seg in gate._keep.segments:
        keys = [k for b in seg.blocks for k in b.keys]
        assert keys == sorted(keys) and len(keys) == seg.size
        assert seg._maxes == [b.keys[-1] for b in seg.blocks]
        for b in seg.blocks:
            assert b.items and b.segment is seg
            assert b.total == sum(a.context for a in b.items)
            assert b.low <= min(a.context for a in b.items)
            assert all(a.block is b for a in b.items)
            seen |= {a.key for a in b.items}
    in_place = {
        a.key
        for a in gate._agents.values()
        if a.state in ("active", "marked")
        or (a.state in ("paused", "pending") and a.waiter is not None)
    }
    assert seen == in_place


async def run_sequence(make_gate, seed: int, n_events: int, new: bool) -> list:
    rng, queries = random.Random(seed), random.Random(-seed)
    now = [0.0]
    unit = rng.choice(["agent", "agent", "request"])
    pause_rule = rng.choice(list(PAUSE_RULES))
    resume_rule = rng.choice(list(RESUME_RULES))
    coming = rng.choice([0, 0, 3])
    gate = make_gate(
        rng.randint(1, 8),
        unit=unit,
        pause_rule=pause_rule,
        resume_rule=resume_rule,
        clock=lambda: now[0],
        coming=lambda: coming,
    )
    keys = [f"a{i}" for i in range(rng.randint(1, 30))]
    tasks: dict[str, asyncio.Task] = {}
    last_ctx = dict.fromkeys(keys, 0)
    trace: list = []
    for _ in range(n_events):
        e = rng.random()
        k = rng.choice(keys)
        if e < 0.45 and k not in tasks:  # a step boundary (also the hot path)
            grow = rng.choice([0, rng.randint(1, 3000), -rng.randint(1, 500), 0])
            last_ctx[k] = max(0, last_ctx[k] + grow) if rng.random() < 0.9 else rng.randint(0, 50)
            tasks[k] = asyncio.ensure_future(gate.acquire(k, last_ctx[k]))
            what = ("acquire", k, last_ctx[k])
        elif e < 0.55:
            gate.done_request(k)
            what = ("done_request", k)
        elif e < 0.62:
            gate.finish(k)
            what = ("finish", k)
        elif e < 0.67 and tasks:
            k = rng.choice(sorted(tasks))
            tasks[k].cancel()
            what = ("cancel", k)
        elif e < 0.85:
            w, bound = rng.randint(0, len(keys) + 3), rng.choice([None, None, rng.randint(0, 9)])
            what = ("resize", w, bound, gate.resize(w, bound))
        elif e < 0.88:
            gate.register(k)
            what = ("register", k)
        elif e < 0.9:  # a policy's own order for a while, or back to the configured one
            pair = (rng.choice(list(PAUSE_RULES)), rng.choice(list(RESUME_RULES)))
            rules = rng.choice([None, pair])
            gate.use_rules(rules)
            what = ("rules", rules)
        else:
            now[0] += rng.choice([0.0, 0.5, 1.0])
            what = ("tick", now[0])
        for _ in range(2):  # let the tasks run: granted ones return, cancelled ones end
            await asyncio.sleep(0)
        for key in sorted(tasks):
            t = tasks[key]
            if t.done():
                del tasks[key]
                exc = "cancelled" if t.cancelled() else t.exception()
                trace.append(("ended", key, repr(exc)))
        trace.append((what, *observe(gate, new, queries, keys)))
        if new:
            check_structure(gate)
    for t in tasks.values():
        t.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    return trace


def observe(gate, new: bool, rng: random.Random, keys: list[str]) -> tuple:
    """What a controller and a display can see; for the new gate, also `fit` and `total` on
    its view against the plain ones on the same contexts (which the trace compares with
    the reference gate's)."""
    if new:
        view = gate.contexts()
        flat = tuple(view)
        held, waiting = flat[: view.held], flat[view.held :]
        assert len(view) == len(flat)
        ref = ContextList(held, waiting)
        for _ in range(2):
            budget = rng.choice([rng.uniform(-10, 40_000), float(rng.randint(0, 20_000)), 0.0])
            extra = rng.choice([0.0, 250.0, rng.uniform(0, 900)])
            shared = rng.choice([0, 0, 40, rng.randint(0, 3000)])
            k = rng.randint(0, len(flat) + 1)
            got = (view.fit(budget, extra, shared), view.total(k))
            assert got == (ref.fit(budget, extra, shared), ref.total(k)), (budget, extra, shared)
            # one prepared fit for many budgets, as _fit_dropping probes it
            fit = view.fitter(extra, shared)
            for b in [*sorted(rng.uniform(-10, 40_000) for _ in range(4)), budget]:
                assert fit(b) == ref.fit(b, extra, shared), (b, extra, shared)
    else:
        held, waiting = gate.contexts()
    return (
        held,
        waiting,
        gate.window,
        gate.counts(),
        gate.drain_events(),
        gate.counters.pauses,
        gate.counters.resumes,
        gate.growth_per_step(),
        gate.wait_totals(),
        *tool_signals(gate, new, held),
        tuple(gate.state(k) for k in keys),
    )


def tool_signals(gate, new: bool, held: tuple[int, ...]) -> tuple:
    """The finished calls' durations (ascending) and the holders past a few times in a call:
    from the new gate's view, and from the reference's tuples through the plain ToolList."""
    tools = gate.tools() if new else ToolList(gate.tool_seconds(), gate.tool_durations(), held)
    past = tuple(tuple(tools.held_past(x)) for x in (0.0, 0.5, 1.0, 1.5, 2.5, 4.0))
    return tuple(tools.durations()), past


@pytest.mark.parametrize(("load", "sequences"), [(1, 400), (4, 800), (128, 400)])
async def test_keep_order_makes_the_same_decisions_as_sorting(monkeypatch, load, sequences):
    monkeypatch.setattr(gate_order, "LOAD", load)

    async def main():
        for seed in range(sequences):
            n = 50
            ref = await run_sequence(reference_gate.Gate, seed, n, new=False)
            got = await run_sequence(Gate, seed, n, new=True)
            for i, (r, g) in enumerate(zip(ref, got, strict=True)):
                assert g == r, f"seed {seed}, step {i}: {g} != {r}"

    await main()


async def test_fit_takes_the_clamp_only_where_a_context_is_below_the_shared_prefix(monkeypatch):
    # a block's lower bound goes stale (its smallest agent left, or grew); fit refreshes it
    # instead of taking the O(n) clamped walk for nothing
    monkeypatch.setattr(gate_order, "LOAD", 2)

    async def main():
        gate = Gate(10)
        for i, ctx in enumerate([100, 5000, 5000, 5000, 5000, 5000]):
            await gate.acquire(f"a{i}", ctx)
        await gate.acquire("a0", 4000)  # the smallest context grew past the shared prefix
        view = gate.contexts()
        low_before = min(b.low for s in gate._keep.segments for b in s.blocks)
        assert low_before == 100
        assert view.fit(30_000.0, 0.0, 1000) == ContextList(tuple(view)).fit(30_000.0, 0.0, 1000)
        assert min(b.low for s in gate._keep.segments for b in s.blocks) == 4000
        with pytest.raises(ValueError, match="extra must be >= 0"):
            view.fit(1.0, -0.5)

    await main()
