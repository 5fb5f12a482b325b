"""wset2's choice of the pause/resume order (`Decision.order`, `fair_below`), the gate rules it
chooses (least-waited, most-waited, `Gate.use_rules`) and the controller that hands the order
from the one to the other, on constructed situations."""

import asyncio
import dataclasses
import typing

import pytest

from runner.engines.protocol import CacheStats
from runner.gate.control import Controller
from runner.gate.gate import PAUSE_RULES, RESUME_RULES, Gate
from runner.policies.protocol import (
    ContextList,
    Decision,
    Order,
    PauseRule,
    ResumeRule,
    Signals,
    ToolList,
)
from runner.policies.registry import make_policy
from runner.policies.wset2 import FAIR, WorkingSet2
from runner.sim.vclock import run_virtual


def sig(capacity=280_000, per=21e-6, durations=(2.7,) * 50, host=None, **kw) -> Signals:
    held = (20_000,) * 10
    base = dict(
        now=100.0, window=10, usage=0.9, hit_rate=0.9, active=10, paused=4, pending=0,
        finished=0, unfinished=14, capacity_tokens=capacity,
        contexts=ContextList(held, (20_000,) * 4), growth_per_step=0.0,
        tools=ToolList((0.0,) * 10, tuple(durations), held), recompute_token_seconds=per,
        host_capacity_tokens=host, host_reload_cost=None if host is None else 0.4,
    )  # fmt: skip
    base.update(kw)
    return Signals(**base)


def test_the_policys_rule_names_are_the_gates():
    assert typing.get_args(PauseRule) == tuple(PAUSE_RULES)
    assert typing.get_args(ResumeRule) == tuple(RESUME_RULES)
    assert str(FAIR) == "least-waited/most-waited"


def test_a_small_pool_that_is_cheap_to_rebuild_spreads_the_waiting():
    # DeepSeek-like: 280K tokens x 21 us = 5.9 s to recompute the pool, tool calls 2.7 s
    # (median): 2.2 calls, under 3, so the gate is asked for the FAIR order; the window is
    # the same fit as without it
    got = WorkingSet2().update(sig())
    assert got.order == FAIR
    assert dataclasses.replace(got, order=None) == WorkingSet2(fair_below=0).update(sig())
    assert WorkingSet2(fair_below=2.0).update(sig()).order is None


def test_where_rebuilding_the_pool_is_dear_the_gate_keeps_its_own_order():
    # Qwen TP2-like: 313K x 64 us = 20 s, 7.4 median calls: LIFO keeps KV warm
    assert WorkingSet2().update(sig(capacity=313_406, per=64e-6)).order is None
    # nearly half the calls a minute long: their mean (27 s) would pass for cheap, but the
    # typical call is half a second (the long ones are the drop's business)
    bimodal = (0.5,) * 55 + (60.0,) * 45
    assert WorkingSet2().update(sig(capacity=876_768, per=36e-6, durations=bimodal)).order is None
    # off, or nothing to judge by: no finished call yet, or no recompute cost reported
    assert WorkingSet2(fair_below=0).update(sig()).order is None
    assert WorkingSet2().update(sig(durations=())).order is None
    assert WorkingSet2().update(sig(per=None)).order is None
    # a host tier counted in the capacity doubles what a rebuild costs: 11.8 s, 4.4 calls
    assert WorkingSet2().update(sig(host=560_000)).order is None
    assert WorkingSet2(use_host=False).update(sig(host=560_000)).order == FAIR
    with pytest.raises(ValueError, match="fair_below"):
        make_policy("wset2:fair_below=-1")


def test_least_waited_pauses_and_most_waited_resumes():
    async def main():
        gate = Gate(3, pause_rule="least-waited", resume_rule="most-waited")
        for k in "ABC":
            await gate.acquire(k, 100)
        gate.resize(2)  # nobody has waited: the newest admitted, C, is marked
        c = asyncio.ensure_future(gate.acquire("C", 100))
        await asyncio.sleep(10)  # C waits 10 s (from t = 0.0)
        gate.resize(3)
        await c
        gate.drain_events()
        gate.resize(1)  # C has waited, A and B not: B then A (newest first) are marked
        marked = [k for e, k in gate.drain_events() if e == "marked"]
        b = asyncio.ensure_future(gate.acquire("B", 100))
        await asyncio.sleep(3)
        a = asyncio.ensure_future(gate.acquire("A", 100))
        await asyncio.sleep(3)  # B has waited 6 s, A 3 s: B is resumed first
        gate.resize(2)
        resumed = [k for e, k in gate.drain_events() if e == "resumed"]
        gate.resize(3)
        await asyncio.gather(a, b)
        return marked, resumed

    marked, resumed = run_virtual(main())
    assert marked == ["B", "A"] and resumed == ["B"]


def test_most_waited_counts_earlier_waits():
    # B has been paused 6 s, C 3 s, but C waited 10 s before: C's 13 s come first (oldest,
    # by when the current pause began, would resume B)
    async def main(rule):
        gate = Gate(3, resume_rule=rule)
        for k in "ABC":
            await gate.acquire(k, 100)
        gate.resize(2)  # C marked, paused at t = 0
        c = asyncio.ensure_future(gate.acquire("C", 100))
        await asyncio.sleep(10)
        gate.resize(3)
        await c
        gate.resize(1)  # newest first: C (just resumed) and B marked
        b = asyncio.ensure_future(gate.acquire("B", 100))
        await asyncio.sleep(3)
        c = asyncio.ensure_future(gate.acquire("C", 100))
        await asyncio.sleep(3)
        gate.drain_events()
        gate.resize(2)
        resumed = [k for e, k in gate.drain_events() if e == "resumed"]
        gate.resize(3)
        await asyncio.gather(b, c)
        return resumed, gate.wait_totals()[0]

    assert run_virtual(main("most-waited")) == (["C"], 10 + 3 + 6)
    assert run_virtual(main("oldest"))[0] == ["B"]


def test_use_rules_reorders_the_waiters_and_none_restores_the_configured_rules():
    async def main():
        gate = Gate(4, pause_rule="newest", resume_rule="newest")
        for k, ctx in zip("ABCD", (100, 200, 300, 400), strict=True):
            await gate.acquire(k, ctx)
        gate.resize(3)  # D marked, then paused
        d = asyncio.ensure_future(gate.acquire("D", 400))
        await asyncio.sleep(5)
        gate.resize(2)  # C marked, then paused 5 s after D
        c = asyncio.ensure_future(gate.acquire("C", 300))
        await asyncio.sleep(1)
        lifo = tuple(gate.contexts())  # newest paused first: C, then D
        gate.use_rules(("least-waited", "most-waited"))  # D has waited longer: first now
        fair = tuple(gate.contexts())
        gate.use_rules(None)
        back = tuple(gate.contexts())
        gate.use_rules(("least-waited", "most-waited"))
        gate.drain_events()
        gate.resize(3)
        resumed = [k for e, k in gate.drain_events() if e == "resumed"]
        gate.resize(4)
        await asyncio.gather(c, d)
        return lifo, fair, back, resumed, (gate.pause_rule, gate.resume_rule)

    lifo, fair, back, resumed, configured = run_virtual(main())
    assert lifo == back == (100, 200, 300, 400)
    assert fair == (100, 200, 400, 300) and resumed == ["D"]
    assert configured == ("newest", "newest")  # what the summary reports
    with pytest.raises(ValueError, match="rules"):
        Gate(1).use_rules(("random", "oldest"))


@dataclasses.dataclass(frozen=True)
class ChoosesFair:
    """A test policy: a fixed window, and the FAIR order from its second period on."""

    name: typing.ClassVar[str] = "test-fair"
    unit: typing.ClassVar[str] = "agent"
    wants_contexts: typing.ClassVar[bool] = False
    wants_tools: typing.ClassVar[bool] = False

    def initial_window(self, n_agents: int) -> int:
        return 2

    def update(self, s: Signals) -> Decision:
        return Decision(2, "fixed", FAIR if s.now >= 1.0 else None)

    def params(self) -> dict:
        return {}


def test_the_controller_hands_the_policys_order_to_the_gate():
    async def main():
        gate = Gate(2, pause_rule="newest", resume_rule="oldest")
        ctl = Controller(gate, ChoosesFair(), lambda: CacheStats(0.1, 1000), 1.0)
        first = ctl.step()
        rules_first = gate.rules
        await asyncio.sleep(1)
        second = ctl.step()
        return first, second, rules_first, gate.rules, ctl.summary()

    first, second, rules_first, rules_second, summary = run_virtual(main())
    assert "order" not in first and rules_first == ("newest", "oldest")
    assert second["order"] == "least-waited/most-waited"
    assert rules_second == ("least-waited", "most-waited")
    assert summary["orders"] == {"least-waited/most-waited": 1}
    assert summary["pause_rule"] == "newest"  # the configured rules, as run with
    assert Order("newest", "oldest") != FAIR


def test_a_wait_from_the_clocks_start_counts():
    # B waits at the gate from t = 0.0 (a virtual clock's start) until A finishes at 4 s:
    # 4 s pending (it counted 0 when the start time 0.0 read as unset)
    async def main():
        gate = Gate(1)
        await gate.acquire("A", 100)
        b = asyncio.ensure_future(gate.acquire("B", 100))
        await asyncio.sleep(4)
        gate.finish("A")
        await b
        return gate.wait_totals()

    assert run_virtual(main()) == (0.0, 4.0)


def test_each_data_parallel_rank_takes_its_own_controllers_order():
    # rank 0's controller chooses FAIR, rank 1's policy no order: only rank 0's gate changes
    from runner.gate.ranked_gate import RankedGate

    async def main():
        gates = [Gate(2, pause_rule="newest", resume_rule="newest") for _ in range(2)]
        ranked = RankedGate(gates, bind=lambda key, rank: None)
        stats = lambda: CacheStats(0.1, 1000)  # noqa: E731
        fair = Controller(ranked.view(0), ChoosesFair(), stats, 1.0, rank=0)
        plain = Controller(ranked.view(1), make_policy("agent-cap:2"), stats, 1.0, rank=1)
        await asyncio.sleep(1)
        fair.step(), plain.step()
        return [g.rules for g in gates]

    assert run_virtual(main()) == [("least-waited", "most-waited"), ("newest", "newest")]
