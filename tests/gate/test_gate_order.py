"""The gate's incremental keep order (runner/gate/gate_order.py) against the plain sort-based gate.

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

from runner.gate import gate as gate_module
from runner.gate import gate_order
from runner.gate.gate import PAUSE_RULES, RESUME_RULES, Gate
from runner.policies.protocol import ContextList, ToolList
from tests.support import reference_gate


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
            assert (b.calls, b.call_total) == call_sums(b)
            assert all(a.block is b for a in b.items)
            seen |= {a.key for a in b.items}
    in_place = {
        a.key
        for a in gate._agents.values()
        if a.state in ("active", "marked")
        or (a.state in ("paused", "pending") and a.waiter is not None)
    }
    assert seen == in_place
    # the open calls are the holders' in a call, which their blocks count
    holders = [a for seg in (gate._keep.active, gate._keep.marked) for a in seg]
    assert set(gate._calls.open) == {a for a in holders if a.tool_since is not None}
    assert all(a.in_call == (a in gate._calls.open) for a in gate._agents.values())


def call_sums(b: gate_order.Block) -> tuple[int, int]:
    """A block's members in a call: how many, and their contexts summed."""
    return sum(a.in_call for a in b.items), sum(a.context for a in b.items if a.in_call)


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


@pytest.mark.parametrize(
    ("load", "run", "sequences"), [(1, 1, 400), (4, 1, 600), (4, 3, 300), (128, 16, 400)]
)
async def test_keep_order_makes_the_same_decisions_as_sorting(monkeypatch, load, run, sequences):
    # run: the fewest agents that move as whole blocks (1: every move of two or more)
    monkeypatch.setattr(gate_order, "LOAD", load)
    monkeypatch.setattr(gate_module, "RUN", run)

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


class _Member:
    def __init__(self, context: int, in_call: bool = False) -> None:
        self.context = context
        self.block = gate_order.UNPLACED
        self.sort_key = None
        self.in_call = in_call
        self.tool_since = 0.0 if in_call else None


def check_segment(seg: gate_order.Segment, model: list) -> None:
    """`seg` holds exactly `model`'s (key, member) pairs in key order, with its blocks'
    sums and bounds right, and no block outside [LOAD / 2, 2 x LOAD] unless it is alone."""
    assert [(k, a) for b in seg.blocks for k, a in zip(b.keys, b.items, strict=True)] == model
    assert seg.size == len(model) and seg._maxes == [b.keys[-1] for b in seg.blocks]
    for b in seg.blocks:
        assert b.segment is seg and all(a.block is b for a in b.items)
        assert b.total == sum(a.context for a in b.items)
        assert b.low <= min(a.context for a in b.items)
        assert (b.calls, b.call_total) == call_sums(b)
        assert len(b.keys) <= 2 * gate_order.LOAD
        assert len(seg.blocks) == 1 or len(b.keys) >= gate_order.LOAD // 2


@pytest.mark.parametrize("load", [1, 4, 8])
def test_runs_taken_from_a_segment_and_put_in_another_keep_both_in_order(monkeypatch, load):
    # the gate marks the newest holders and unmarks the oldest marked ones as runs (whole
    # blocks); where a run would interleave with the other segment's keys, `put` refuses
    # and the members are added one by one
    monkeypatch.setattr(gate_order, "LOAD", load)
    rng = random.Random(load)
    segs = (gate_order.Segment(), gate_order.Segment())
    models: tuple[list, list] = ([], [])
    keys = rng.sample(range(10_000), 400)
    for k in keys[:300]:
        a = _Member(rng.randint(0, 5000), rng.random() < 0.3)
        side = rng.randrange(2)
        segs[side].add(a, k)
        models[side].append((k, a))
    for m in models:
        m.sort()
    for _ in range(400):
        src = rng.randrange(2)
        seg, dst, model = segs[src], segs[1 - src], models[src]
        k = rng.choice([0, 1, 2, rng.randint(0, 40), len(model), len(model) + 3])
        first = rng.random() < 0.5
        blocks = seg.take_first(k) if first else seg.take_last(k)
        k = min(k, len(model))
        run = model[:k] if first else model[len(model) - k :]
        model[:] = model[k:] if first else model[: len(model) - k]
        assert [(key, a) for b in blocks for key, a in zip(b.keys, b.items, strict=True)] == run
        assert all(b.segment is None for b in blocks)
        keys_dst = [key for key, _ in models[1 - src]]
        interleaves = bool(run and keys_dst) and not (
            run[0][0] > keys_dst[-1] or run[-1][0] < keys_dst[0]
        )
        assert dst.put(blocks) is not interleaves
        if interleaves:
            for key, a in run:
                dst.add(a, key)
        models[1 - src][:] = sorted(models[1 - src] + run)
        if rng.random() < 0.3 and model:  # single removals in between, as the gate does
            key, a = model.pop(rng.randrange(len(model)))
            seg.remove(a)
        check_segment(segs[0], models[0])
        check_segment(segs[1], models[1])


async def test_many_holders_past_a_time_in_a_call_come_in_place_order():
    # hundreds of holders past the time, some of them marked: the same pairs, in the same
    # order, as the plain list over the holders in order
    rng, now = random.Random(5), [0.0]
    gate = Gate(400, clock=lambda: now[0])
    keys = [f"a{i}" for i in range(600)]
    tasks = [asyncio.ensure_future(gate.acquire(k, rng.randint(100, 30_000))) for k in keys]
    await asyncio.sleep(0)
    for k in rng.sample(keys[:400], 330):
        gate.done_request(k)
        now[0] += rng.choice([0.0, 0.01, 0.02])
    gate.resize(350)  # 50 holders marked: they come after the active ones
    now[0] += 10.0
    holders = [*gate._keep.active, *gate._keep.marked]
    seconds = tuple(0.0 if a.tool_since is None else now[0] - a.tool_since for a in holders)
    plain = ToolList(seconds, (), tuple(a.context for a in holders))
    view = gate.tools()
    for x in (0.0, 5.0, 10.0, 11.0, 14.0):
        assert view.held_past(x) == plain.held_past(x), x
        assert view.count_past(x) == plain.count_past(x) == len(plain.held_past(x)), x
    assert len(view.held_past(0.0)) == 330
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
