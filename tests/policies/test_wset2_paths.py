"""wset2's decisions through the gate's tool-call view (runner/gate/gate_order.py: the holders in
a call by when it began, the finished durations sorted; numpy's mean excess, the prepared
fit) against the path it replaced (tests/support/reference_wset2.py, on tuples from the sort-based
reference gate): random event sequences through both gates, and after every event the same
time from which KV is dropped, the same dropped holders, the same fit and the same decision
for random policy settings and engines."""

import asyncio
import dataclasses
import random
import statistics
from collections import Counter

import pytest

from runner.gate import gate as gate_module
from runner.gate import gate_order, tool_calls
from runner.gate.gate import PAUSE_RULES, RESUME_RULES, Gate
from runner.policies.fit import _capacity
from runner.policies.protocol import ContextList, Signals
from runner.policies.wset2 import (
    FAIR,
    WorkingSet2,
    _fit_dropping,
    _held_past,
    _RemainingTime,
    _tool_calls,
)
from tests.support import reference_gate, reference_wset2


def signals(s_kw: dict, contexts, tools) -> Signals:
    return Signals(contexts=contexts, tools=tools, **s_kw)


def compare(
    gate: Gate, ref: reference_gate.Gate, rng: random.Random, now: float, fast: Counter
) -> int:
    """The new path on the gate's views against the old one on the reference's tuples, for a
    few random settings; returns how many holders the old path dropped in all. `fast`
    counts the dropped-holder fits the view's per-block sums answered (and was asked)."""
    held, waiting = ref.contexts()
    old_contexts = ContextList(held, waiting)
    held_s, durations = ref.tool_seconds(), ref.tool_durations()
    assert tuple(gate.contexts()) == held + waiting
    dropped_total = 0
    for _ in range(3):
        capacity = rng.choice([5_000, 20_000, 60_000, rng.randint(1_000, 100_000)])
        policy = WorkingSet2(
            reserve=rng.choice([0.0, 0.1, 0.3]),
            headroom_steps=rng.choice([0.0, 1.0]),
            drop_factor=rng.choice([0.05, 0.3, 1.0, 3.0]),
            fair_below=rng.choice([0.0, 2.0, 50.0]),
            drop_after_median=rng.choice([True, False]),
        )
        break_even = rng.choice([0.3, 1.0, rng.uniform(0.01, 6.0)])  # seconds
        s_kw = dict(
            now=now, window=gate.window, usage=0.3, hit_rate=0.5,
            active=len(held), paused=0, pending=len(waiting), finished=0,
            unfinished=len(held) + len(waiting), capacity_tokens=capacity,
            recompute_token_seconds=rng.choice([None, break_even / capacity]),
            growth_per_step=rng.choice([None, 0.0, 300.0, rng.uniform(0, 900)]),
            recompute_rate=rng.choice([None, 0.1, 0.5]),
            shared_tokens=rng.choice([None, 0, 40, rng.randint(0, 3000)]),
        )  # fmt: skip
        new_s = signals(s_kw, gate.contexts(), gate.tools())
        old_s = signals(s_kw, old_contexts, None)
        per = new_s.recompute_token_seconds
        calls = _tool_calls(new_s) if per else None
        after = policy._drop_after(calls, _capacity(new_s, True), per)
        assert after == reference_wset2._drop_after(policy, old_s, capacity, durations)
        if after is not None:
            dropped = _held_past(new_s, after)
            old_past = [(i, held[i]) for i, t in enumerate(held_s) if t > 0 and t >= after]
            assert dropped == old_past
            dropped_total += len(dropped)
            budget = rng.uniform(-10, 2 * capacity)
            extra, shared = rng.choice([0.0, 250.0]), rng.choice([0, 800])
            want_fit = reference_wset2._fit_dropping(
                old_contexts, budget, extra, shared, [p for p, _ in dropped]
            )
            assert _fit_dropping(new_s.contexts, budget, extra, shared, dropped) == want_fit
            # from the blocks' sums: the same count, or None (a near tie: the path above)
            for b in (budget, float(round(budget)), rng.uniform(-10, 2 * capacity)):
                got_fit = new_s.tools.fit_dropping(new_s.contexts, after, b, extra, shared)
                want_b = reference_wset2._fit_dropping(
                    old_contexts, b, extra, shared, [p for p, _ in dropped]
                )
                assert got_fit in (None, want_b), (b, extra, shared, got_fit, want_b)
                fast.update(asked=1, answered=got_fit is not None)
                near_or_far(gate, after, b, extra, shared, fast)
        got = policy.update(new_s)
        want = reference_wset2.update(policy, old_s, held_s, durations)
        # the order: FAIR where the pool is recomputed in under fair_below median calls
        spread = bool(policy.fair_below and per and durations) and capacity * per < (
            policy.fair_below * statistics.median_high(durations)
        )
        assert got == (dataclasses.replace(want, order=FAIR) if spread else want)
    return dropped_total


def near_or_far(gate: Gate, after: float, budget: float, extra: float, shared: int, fast: Counter):
    """The fit near the holders' end (`_fit_near_turn`) answers as the per-block counts
    (`_FitPast`) do wherever it answers; `fast` counts where it did, by where the budget ran
    out (after the holders, in their last blocks), and where it left it to `_FitPast`."""
    view, order, calls = gate.tools(), gate._keep, gate._calls
    n = calls.begun_by(view._past(after), view._turn(after))
    if not n or budget < 0:
        return
    near = tool_calls._fit_near_turn(order, calls, n, budget, extra, shared)
    per_block = tool_calls._FitPast(gate.contexts()._blocks(), *view._dropped(n), extra, shared)
    if isinstance(near, tool_calls._Far):
        fast.update(far=1)
        return
    assert near == per_block(budget), (budget, extra, shared, near)
    fast.update(near_after=near is not None and near >= gate.contexts().held)
    fast.update(near_back=near is not None and near < gate.contexts().held)


async def run_sequence(seed: int, n_events: int, fast: Counter) -> int:
    rng, queries = random.Random(seed), random.Random(-seed)
    now = [0.0]
    rules = dict(
        pause_rule=rng.choice(list(PAUSE_RULES)), resume_rule=rng.choice(list(RESUME_RULES))
    )
    window = rng.randint(1, 12)
    gate = Gate(window, clock=lambda: now[0], **rules)
    ref = reference_gate.Gate(window, clock=lambda: now[0], **rules)
    keys = [f"a{i}" for i in range(rng.randint(1, 30))]
    tasks: dict[str, tuple[asyncio.Future, asyncio.Future]] = {}
    ctx = dict.fromkeys(keys, 0)
    dropped = 0
    for _ in range(n_events):
        e, k = rng.random(), rng.choice(keys)
        if e < 0.4 and k not in tasks:  # a step boundary (the end of a tool call)
            ctx[k] = max(0, ctx[k] + rng.choice([0, rng.randint(1, 3000), -rng.randint(1, 500)]))
            tasks[k] = (
                asyncio.ensure_future(gate.acquire(k, ctx[k])),
                asyncio.ensure_future(ref.acquire(k, ctx[k])),
            )
        elif e < 0.6:  # a request ends: a tool call begins
            gate.done_request(k)
            ref.done_request(k)
        elif e < 0.64:
            gate.finish(k)
            ref.finish(k)
        elif e < 0.67 and tasks:
            for t in tasks[rng.choice(sorted(tasks))]:
                t.cancel()
        elif e < 0.75:
            w = rng.randint(0, len(keys) + 3)
            assert gate.resize(w) == ref.resize(w)
        else:  # time moves: by a few set steps (ties among the durations) or any amount
            now[0] += rng.choice([0.0, 0.5, 1.0, rng.uniform(0.0, 3.0), rng.expovariate(0.2)])
        for _ in range(2):
            await asyncio.sleep(0)
        for key in sorted(tasks):
            if all(t.done() for t in tasks[key]):
                del tasks[key]
        dropped += compare(gate, ref, queries, now[0], fast)
    for pair in tasks.values():
        for t in pair:
            t.cancel()
    await asyncio.gather(*(t for pair in tasks.values() for t in pair), return_exceptions=True)
    return dropped


@pytest.mark.parametrize(("kept", "sequences"), [(1000, 150), (7, 150)])
async def test_wset2_decides_as_the_path_it_replaced(monkeypatch, kept, sequences):
    # tiny blocks (many of them) and, in one run, few kept durations (the oldest evicted
    # from the sorted array all the time)
    monkeypatch.setattr(gate_order, "LOAD", 2)
    # the block where the budget runs out read from its end 1, 2, 4, ... members at a time
    monkeypatch.setattr(tool_calls, "TAIL", 1)
    monkeypatch.setattr(gate_module, "TOOL_DURATIONS_KEPT", kept)
    monkeypatch.setattr(reference_gate, "TOOL_DURATIONS_KEPT", kept)
    dropped, fast = 0, Counter[str]()
    for seed in range(sequences):
        dropped += await run_sequence(seed, 120, fast)
    assert dropped > 1000  # the sequences do drop holders: the comparison is not vacuous
    # the per-block sums answer nearly every fit (None only at a near tie)
    assert fast["answered"] > 0.95 * fast["asked"] > 1000, fast
    # both ways the fit near the holders' end answers, and the per-block path, are taken
    assert min(fast["near_after"], fast["near_back"], fast["far"]) > 200, fast


def test_remaining_time_is_the_scalar_scan_it_replaced():
    rng = random.Random(9)
    for _ in range(400):
        durations = tuple(
            rng.choice([0.0, 0.5, 1.0, 2.5, rng.uniform(0, 90), rng.expovariate(0.1)])
            for _ in range(rng.randint(1, 60))
        )
        new, old = _RemainingTime(sorted(durations)), reference_wset2._RemainingTime(durations)
        for x in [rng.uniform(0, 100) for _ in range(5)] + list(durations[:5]) + [0.0]:
            assert new.first_above(x) == old.first_above(x)
            assert new.expected(x) == old.expected(x)


async def test_the_fit_from_block_sums_leaves_a_tie_to_the_float_sums():
    # a holder past the time counts 0; where the budget is exactly a prefix's total the
    # view answers None (the two paths' roundings could part there) and the holder-by-holder
    # path decides; a budget clear of every total gets the same count from both
    now = [0.0]
    gate = Gate(4, clock=lambda: now[0])
    for k, c in {"a": 1000, "b": 2000, "c": 3000, "d": 4000}.items():
        await gate.acquire(k, c)
    gate.done_request("b")
    now[0] += 5.0
    view, contexts = gate.tools(), gate.contexts()
    held = view.held_past(1.0)
    assert held == [(1, 2000)]
    for budget, count in [(4000.5, 3), (3999.5, 2), (0.0, 0), (1e9, 4), (7999.0, 3)]:
        assert view.fit_dropping(contexts, 1.0, budget) == count
        assert _fit_dropping(contexts, budget, 0.0, 0, held) == count
    assert view.fit_dropping(contexts, 1.0, 4000.0) is None  # a, b, c total 4000 exactly
    assert _fit_dropping(contexts, 4000.0, 0.0, 0, held) == 3
    assert view.fit_dropping(contexts, 1.0, 1000.0) is None  # a, b total 1000 exactly
    # b not past 6 s: nothing dropped, the plain fit (a totals 1000: within)
    assert view.held_past(6.0) == []
    assert view.fit_dropping(contexts, 6.0, 1000.0) == 1 == contexts.fit(1000.0)
    assert (
        view.fit_dropping(contexts, 6.0, 2999.0)
        == 1
        == _fit_dropping(contexts, 2999.0, 0.0, 0, view.held_past(6.0))
    )
    # another gate's contexts, or plain tuples: no per-block sums to read
    assert view.fit_dropping(Gate(1).contexts(), 1.0, 4000.5) is None
    assert view.fit_dropping(ContextList((1000, 2000), ()), 1.0, 4000.5) is None
    # the policy takes the holder-by-holder path at the tie: the same window as with none
    gate.done_request("d")  # a finished call, so that wset2 has a remaining time to weigh
    now[0] += 60.0
    await gate.acquire("d", 4000)
    s_kw = dict(
        now=now[0], window=4, usage=0.3, hit_rate=0.5, active=4, paused=0, pending=0,
        finished=0, unfinished=4, capacity_tokens=4000, recompute_token_seconds=1e-3,
    )  # fmt: skip
    policy = WorkingSet2(reserve=0.0, fair_below=0.0)
    assert policy.update(signals(s_kw, gate.contexts(), gate.tools())).window == 3
