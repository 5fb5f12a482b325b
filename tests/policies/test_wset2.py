"""wset2's decisions on constructed situations, and the signals it reads (tool seconds from
the gate, the recompute cost from the simulated engine)."""

import asyncio
import random

import pytest

from runner.engines.chatml_tokenizer import ChatMLTokenizer
from runner.engines.protocol import CacheStats
from runner.gate.control import Controller
from runner.gate.gate import Gate
from runner.policies.aimd import AIMD
from runner.policies.experimental.wset import WorkingSet
from runner.policies.protocol import ContextList, Signals, ToolList
from runner.policies.registry import make_policy
from runner.policies.wset2 import WorkingSet2, _RemainingTime
from runner.sim.engine import make_sim_engine
from runner.sim.vclock import run_virtual


def ws_sig(held, waiting, capacity=10_000, held_tool_seconds=(), tool_durations=(), **kw):
    base = dict(
        now=0.0,
        window=max(1, len(held)),
        usage=0.3,
        hit_rate=0.9,
        active=len(held),
        paused=0,
        pending=len(waiting),
        finished=0,
        unfinished=len(held) + len(waiting),
        capacity_tokens=capacity,
        contexts=ContextList(tuple(held), tuple(waiting)),
        growth_per_step=0.0,
        tools=ToolList(tuple(held_tool_seconds), tuple(tool_durations), tuple(held)),
    )
    base.update(kw)
    return Signals(**base)


# tools of a bimodal workload: most under a second, a fifth a minute
BIMODAL = (0.5,) * 80 + (60.0,) * 20


def test_a_burst_that_would_overflow_closes_the_window():
    # four agents resident in a 10K pool; one just appended a huge observation
    assert WorkingSet2().update(ws_sig([2000] * 4, [])).window == 4
    assert WorkingSet2().update(ws_sig([2000, 2000, 2000, 6000], [])).window == 3


def test_a_swarm_in_warmup_is_admitted_at_once():
    # 2,048 short agents on a 2M-token pool, nothing resident yet: all fit the first period
    s = ws_sig([], [300] * 2048, capacity=2_000_000, shared_tokens=200, growth_per_step=100.0)
    assert WorkingSet2().update(s).window == 2048
    assert WorkingSet2().initial_window(2048) == 2048
    assert AIMD().initial_window(2048) == 4  # the paper's law starts at 4


def test_it_never_plans_past_the_pool():
    # the share is a reserve in [0, 1): no setting overcommits the device (the wset target
    # above 1 thrashed: 1.1 took 2.3x the time of 0.9 on Qwen TP8)
    assert WorkingSet2(reserve=0.0).update(ws_sig([2500] * 4, [2500])).window == 4
    with pytest.raises(ValueError, match="reserve"):
        WorkingSet2(reserve=-0.1)
    with pytest.raises(ValueError, match="reserve"):
        WorkingSet2(reserve=1.0)
    with pytest.raises(ValueError, match="drop_factor"):
        make_policy("wset2:drop_factor=0")


def test_an_agent_in_a_long_tool_call_holds_no_share_of_the_pool():
    # four agents of 2,000 tokens in a 10K pool; the first has spent 5 s in a tool. Finished
    # calls were 0.5 s or 60 s, so it is in a 60 s call: 55 s to go, past the break-even of
    # 10K tokens x 1.5 ms a token = 15 s. Its KV is not held and a fifth agent is admitted.
    # The third is 0.2 s into its call: 12.2 s to go on average (most calls end at once), so
    # it keeps its share.
    long_wait = dict(
        held_tool_seconds=(5.0, 0.0, 0.2, 0.0),
        tool_durations=BIMODAL,
        recompute_token_seconds=0.0015,
    )
    d = WorkingSet2().update(ws_sig([2000] * 4, [2000, 2000], **long_wait))
    assert d.window == 5
    # wset holds it: four
    assert WorkingSet().update(ws_sig([2000] * 4, [2000, 2000], **long_wait)).window == 4
    # the same wait where recomputing is dear (break-even 100 s): held
    dear = {**long_wait, "recompute_token_seconds": 0.01}
    assert WorkingSet2().update(ws_sig([2000] * 4, [2000, 2000], **dear)).window == 4
    # drop_factor scales the break-even: at 10 s even a call just begun (12.4 s to go on
    # average) would be worth dropping, but not before the median call (0.5 s) has ended
    cheap = WorkingSet2(drop_factor=0.1)
    assert cheap.update(ws_sig([2000] * 4, [2000] * 3, **dear)).window == 5
    # without that floor both agents in tools leave room
    early = WorkingSet2(drop_factor=0.1, drop_after_median=False)
    assert early.update(ws_sig([2000] * 4, [2000] * 3, **dear)).window == 6
    # no finished tool call yet, or no recompute cost from the engine: nothing is dropped
    for missing in ({"tool_durations": ()}, {"recompute_token_seconds": None}):
        s = ws_sig([2000] * 4, [2000], **{**long_wait, **missing})
        assert WorkingSet2().update(s).window == 4


def test_a_call_shorter_than_the_median_keeps_its_share():
    # calls of 1-4 s and a third of 60 s: a call just begun has 21 s to go on average, past
    # the 15 s break-even, yet most end within 4 s. Held until the median call (4 s) has
    # ended; from then on only 60 s calls remain (56 s to go), and its KV is dropped.
    tools = (1.0, 2.0, 3.0, 4.0) * 10 + (60.0,) * 20
    kw = dict(tool_durations=tools, recompute_token_seconds=0.0015)
    for spent, window in ((0.5, 4), (3.9, 4), (4.0, 5), (30.0, 5)):
        s = ws_sig([2000] * 4, [2000] * 2, held_tool_seconds=(spent, 0.0, 0.0, 0.0), **kw)
        assert WorkingSet2().update(s).window == window, spent
    begun = ws_sig([2000] * 4, [2000] * 2, held_tool_seconds=(0.5, 0.0, 0.0, 0.0), **kw)
    assert WorkingSet2(drop_after_median=False).update(begun).window == 5


def test_the_window_stays_within_the_contexts_the_engine_keeps():
    # llama.cpp keeps one context per sequence slot: 6 slots, though 10 agents fit the tokens
    assert WorkingSet2().update(ws_sig([500] * 4, [500] * 6, resident_limit=6)).window == 6
    assert WorkingSet2().update(ws_sig([500] * 4, [500] * 6)).window == 10


def test_a_dropped_context_stays_dropped_as_its_call_nears_its_end():
    # calls of 40-80 s: at 70 s the expected remainder is 5 s, below the 10 s break-even,
    # but it passed it earlier in the call, so the KV is gone: still counted as nothing
    tools = tuple(40.0 + i for i in range(41))
    s = ws_sig(
        [2000] * 4,
        [2000],
        held_tool_seconds=(70.0, 0.0, 0.0, 0.0),
        tool_durations=tools,
        recompute_token_seconds=0.001,
    )
    assert WorkingSet2().update(s).window == 5


def test_a_host_tier_with_limited_bandwidth():
    # 8 agents of 2,000 tokens, 10K device pool, a 20K host tier (write-through)
    held = [2000] * 8
    fast = ws_sig(held, [], host_capacity_tokens=20_000, host_reload_cost=0.05)
    assert WorkingSet2().update(fast).window == 8  # the host tier beyond the device counts
    slow = ws_sig(held, [], host_capacity_tokens=20_000, host_reload_cost=1.3)
    assert WorkingSet2().update(slow).window == 4  # a reload dearer than a recompute: not
    assert WorkingSet2(use_host=False).update(fast).window == 4
    # with the tier counted, what the tiers cannot hold is recomputed: the break-even is
    # 20K tokens x 1 ms = 20 s, so a call with 15 s to go keeps its KV (in one tier or the
    # other), where on the device alone (10 s) it would be dropped
    wait = dict(  # past 2 s (the median call), only 20 s calls are left
        held_tool_seconds=(5.0,) + (0.0,) * 9,
        tool_durations=(2.0,) * 6 + (20.0,) * 4,
        recompute_token_seconds=0.001,
    )
    tiered = ws_sig([2000] * 10, [2000], **wait, host_capacity_tokens=20_000, host_reload_cost=0.05)
    assert WorkingSet2().update(tiered).window == 9
    device = ws_sig([2000] * 5, [2000], **{**wait, "held_tool_seconds": (5.0,) + (0.0,) * 4})
    assert WorkingSet2().update(device).window == 5


def test_it_cuts_on_recompute_and_falls_back_without_capacity():
    d = WorkingSet2().update(ws_sig([1000] * 8, [], window=8, recompute_rate=0.5))
    assert (d.window, d.branch) == (4, "cut:recompute")
    # while holders' KV is dropped, their returns are recomputed by design: no cut for it
    # (issue 31: a bimodal DeepSeek family instance, 2,147 s with the cut, 1,853 s without,
    # no gate 1,935 s)
    dropping = dict(
        held_tool_seconds=(5.0,) + (0.0,) * 4,
        tool_durations=BIMODAL,
        recompute_token_seconds=0.0015,
        recompute_rate=0.5,
    )
    d = WorkingSet2().update(ws_sig([1000] * 5, [1000] * 4, window=5, **dropping))
    assert (d.window, d.branch) == (9, "fit:dropping")
    d = WorkingSet2(trust_drops=False).update(ws_sig([1000] * 5, [1000] * 4, window=5, **dropping))
    assert (d.window, d.branch) == (2, "cut:recompute")
    d = WorkingSet2().update(ws_sig([1000] * 8, [], capacity=None))
    assert d.branch.startswith("aimd-fallback")


def test_remaining_time_is_the_mean_excess_of_longer_calls():
    rng = random.Random(3)
    for _ in range(300):
        durations = tuple(
            rng.choice([0.3, 1.0, 2.5, 40.0, 61.0]) for _ in range(rng.randint(1, 30))
        )
        r = _RemainingTime(sorted(durations))
        for spent in (0.1, 1.0, 2.0, 30.0, 50.0, 70.0):
            longer = [d - spent for d in durations if d > spent]
            want = sum(longer) / len(longer) if longer else spent
            assert r.expected(spent) == pytest.approx(want)
        # first_above(x): from when a call's expected remainder has passed x (at any time
        # so far: its peak), found on a grid of times against the plain definition
        x = rng.uniform(0.1, 80.0)
        after = r.first_above(x)
        for spent in [rng.uniform(0.01, 90.0) for _ in range(20)] + list(durations):
            points = [0.0, *(d for d in durations if d <= spent), spent]
            assert (spent >= after) == (max(r.expected(t) for t in points) > x)


def test_the_gate_reports_tool_seconds_of_holders_and_finished_calls():
    async def main():
        gate = Gate(3)
        for k in "ABC":
            gate.register(k)
        await gate.acquire("A", 100)
        await gate.acquire("B", 200)
        await asyncio.sleep(1.0)
        gate.done_request("A")  # A's request ends: it is in a tool
        await asyncio.sleep(2.5)
        tools = gate.tools()
        assert tools.held_past(2.5) == [(0, 100)]  # B's request is still in the engine
        assert tools.held_past(2.6) == []
        assert list(tools.durations()) == []
        await gate.acquire("A", 150)  # back from a 2.5 s call
        assert gate.tools().held_past(0.0) == []
        assert list(gate.tools().durations()) == [2.5]
        ctl = Controller(gate, make_policy("wset2"), lambda: CacheStats(0.1, 1000), 1.0)
        gate.done_request("B")
        await asyncio.sleep(1.0)
        ctl.step()
        return ctl

    ctl = run_virtual(main())
    assert ctl.stats.last["branch"] == "fit"


def test_the_simulated_engine_reports_its_recompute_cost():
    eng = make_sim_engine("qwen3-32b-tp4", ChatMLTokenizer(), lambda ids: [])
    per_token = eng.cache_stats().recompute_token_seconds
    # a full 8,192-token chunk from position 0, per token: ~36 us on 4 H100s
    assert per_token == pytest.approx(eng.cost.prefill([(0, 8192)]).seconds / 8192)
    assert 1e-5 < per_token < 1e-4


def test_through_the_runner_long_tool_calls_give_their_room_to_others(tmp_path):
    # a pressured batch (contexts of 3-6K in a 9K pool) where a third of the tools take
    # 20-40 s, on an engine whose recompute is cheap (break-even well under a second):
    # wset holds the KV of agents in those calls, wset2 admits others in their place and
    # pays recomputes for it, and finishes sooner with the same work
    from runner.sim.simulate import simulate
    from runner.sim.workload import synthetic

    w = synthetic("tiny", seed=3, final=(3000, 6000), gen=(30, 60), slow_tools=(0.3, 20.0, 40.0))
    opts = {"max_total_tokens": 9000}
    runs = {
        p: simulate(
            w,
            "tiny-cpu",
            make_policy(p),
            tmp_path / p,
            resume_rule="newest",
            engine_options=opts,
            control_period=0.5,
        )
        for p in ("wset", "wset2")
    }
    ws, ws2 = runs["wset"], runs["wset2"]
    assert ws2.work == ws.work
    assert ws2.gate["window"]["mean"] > ws.gate["window"]["mean"]
    assert ws2.engine["tokens_prefill_recompute"] > ws.engine["tokens_prefill_recompute"]
    assert ws2.sim_seconds < ws.sim_seconds


def test_the_fit_with_dropped_holders_is_the_plain_running_sum():
    from runner.policies.wset2 import _fit_dropping

    rng = random.Random(11)
    for _ in range(3000):
        held = tuple(rng.randint(0, 5000) for _ in range(rng.randint(0, 20)))
        waiting = tuple(rng.randint(0, 5000) for _ in range(rng.randint(0, 20)))
        shared, growth = rng.choice([0, 800]), rng.choice([0.0, 250.0])
        dropped = sorted(rng.sample(range(len(held)), rng.randint(0, len(held))))
        budget = rng.uniform(-10, 60_000)
        fit, left = 0, budget
        for i, ctx in enumerate((*held, *waiting)):
            left -= 0 if i in dropped else max(0, ctx - shared) + growth
            if left < 0:
                break
            fit += 1
        pairs = [(i, held[i]) for i in dropped]
        assert _fit_dropping(ContextList(held, waiting), budget, growth, shared, pairs) == fit


async def test_the_fit_with_dropped_holders_on_the_gates_view(monkeypatch):
    # the gate's live view (tiny blocks: many of them) gives the same count as the plain
    # running sum over the same contexts, for holders dropped anywhere among the holders
    from runner.gate import gate_order
    from runner.policies.wset2 import _fit_dropping

    monkeypatch.setattr(gate_order, "LOAD", 2)
    rng = random.Random(5)

    async def main():
        for _ in range(60):
            n = rng.randint(1, 40)
            gate = Gate(rng.randint(1, n))
            tasks = [
                asyncio.ensure_future(gate.acquire(f"a{i}", rng.randint(0, 5000))) for i in range(n)
            ]
            await asyncio.sleep(0)
            view = gate.contexts()
            flat = tuple(view)
            for _ in range(20):
                shared, growth = rng.choice([0, 800]), rng.choice([0.0, 250.0])
                dropped = sorted(rng.sample(range(view.held), rng.randint(1, view.held)))
                budget = rng.uniform(-10, 80_000)
                fit, left = 0, budget
                for i, ctx in enumerate(flat):
                    left -= 0 if i in dropped else max(0, ctx - shared) + growth
                    if left < 0:
                        break
                    fit += 1
                pairs = [(i, flat[i]) for i in dropped]
                assert _fit_dropping(view, budget, growth, shared, pairs) == fit
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    await main()
