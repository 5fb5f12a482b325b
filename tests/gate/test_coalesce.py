"""Coalescing (runner.policies.protocol.Coalesce, Gate.coalesce): slot holders back from a tool are
held a moment so that their requests reach the engine together, and wset2 asks for it only
where requests come often enough for a hold to gather several."""

import asyncio

import pytest

from runner.engines.protocol import CacheStats
from runner.gate.control import Controller
from runner.gate.gate import Gate
from runner.policies.protocol import Coalesce, Decision, Signals
from runner.policies.registry import make_policy
from runner.policies.wset2 import WorkingSet2
from runner.sim.vclock import run_virtual


def now() -> float:
    return asyncio.get_running_loop().time()


async def step(gate: Gate, key: str, context: int, log: list[tuple[float, str]]) -> None:
    await gate.acquire(key, context)
    log.append((now(), key))
    gate.done_request(key)


async def holders(keys: str, context: int) -> tuple[Gate, list[tuple[float, str]]]:
    """A gate whose agents `keys` have each sent a first request of `context` tokens (nothing
    to hold: they come from no tool), and an empty log."""
    gate, log = Gate(len(keys)), []
    for k in keys:
        await step(gate, k, context, log)
    log.clear()
    return gate, log


def test_holders_back_from_a_tool_wait_for_the_hold_then_go_together():
    async def main():
        gate, log = Gate(3), []
        for k in "ABC":
            await step(gate, k, 100, log)  # first requests: nothing to hold
        assert [t for t, _ in log] == [0.0, 0.0, 0.0]
        gate.coalesce(0.5, 10_000)
        log.clear()
        a = asyncio.create_task(step(gate, "A", 300, log))  # back at 0.0
        await asyncio.sleep(0.2)
        b = asyncio.create_task(step(gate, "B", 300, log))  # back at 0.2
        await asyncio.sleep(0.1)
        assert log == []  # both held
        await asyncio.gather(a, b)
        assert log == [(0.5, "A"), (0.5, "B")]  # the first one's hold ends: all go
        assert gate.counters.holds == 2
        assert gate.counters.hold_seconds == pytest.approx(0.5 + 0.3)

    run_virtual(main())


def test_a_hold_ends_early_once_the_held_bring_enough_tokens():
    async def main():
        gate, log = await holders("ABC", 1_000)
        gate.coalesce(5.0, 1_000)
        a = asyncio.create_task(step(gate, "A", 1_600, log))  # 600 new tokens: held
        await asyncio.sleep(1.0)
        b = asyncio.create_task(step(gate, "B", 1_500, log))  # 1,100 in all: both go
        await asyncio.gather(a, b)
        assert sorted(log) == [(1.0, "A"), (1.0, "B")] and gate.counters.holds == 1
        c = asyncio.create_task(step(gate, "C", 1_001, log))  # a new hold, from 1.0
        await c
        assert log[-1] == (6.0, "C")

    run_virtual(main())


def test_no_hold_for_first_requests_waiters_or_without_coalescing():
    async def main():
        gate, log = Gate(1), []
        gate.coalesce(1.0, 10_000)
        await step(gate, "A", 100, log)  # its first request
        b = asyncio.create_task(step(gate, "B", 100, log))  # waits for a slot, not a hold
        await asyncio.sleep(0)
        gate.finish("A")
        await b
        assert log == [(0.0, "A"), (0.0, "B")]
        gate.coalesce(0.0, 0)
        await step(gate, "B", 200, log)  # back from a tool, but no coalescing now
        assert log[-1] == (0.0, "B") and gate.counters.holds == 0

    run_virtual(main())


def test_turning_coalescing_off_lets_the_held_go_at_once():
    async def main():
        gate, log = await holders("AB", 100)
        gate.coalesce(10.0, 10_000)
        a = asyncio.create_task(step(gate, "A", 200, log))
        await asyncio.sleep(2.0)
        gate.coalesce(0.0, 0)
        await a
        assert log == [(2.0, "A")]

    run_virtual(main())


def test_a_cancelled_held_agent_leaves_the_hold():
    async def main():
        gate, log = await holders("AB", 100)
        gate.coalesce(1.0, 250)
        a = asyncio.create_task(step(gate, "A", 200, log))
        await asyncio.sleep(0.1)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        await step(gate, "B", 200, log)  # 100 new tokens: A's 100 no longer count
        assert log == [(1.1, "B")] and gate.counters.holds == 1  # its own hold, from 0.1

    run_virtual(main())


def signals(rate: float | None) -> Signals:
    return Signals(
        now=10.0, window=8, usage=0.5, hit_rate=0.9, active=8, paused=0, pending=0,
        finished=0, unfinished=8, capacity_tokens=1_000_000, requests_per_second=rate,
    )  # fmt: skip


def test_wset2_coalesces_only_where_a_hold_would_gather_several_requests():
    p = WorkingSet2()  # holds 0.2 s where >= 2 requests are expected in one: 10 per second
    assert p.update(signals(None)).coalesce is None  # no rate measured yet
    assert p.update(signals(9.9)).coalesce is None  # a hold would mostly delay one agent
    d = p.update(signals(10.0))
    assert d.coalesce == Coalesce(0.2, 8192)
    assert d.window == p.update(signals(9.9)).window  # the window is decided alone
    assert WorkingSet2(hold_seconds=0.0).update(signals(1e6)).coalesce is None
    assert make_policy("wset2:hold_seconds=0.5,hold_min=1").update(signals(2.0)).coalesce
    for bad in ("hold_seconds=-1", "hold_tokens=0", "hold_min=-0.5"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            make_policy(f"wset2:{bad}")


def test_the_controller_hands_the_hold_to_the_gate_and_counts_it():
    class Every(WorkingSet2):  # wset2's decision with coalescing asked in odd periods
        def update(self, s: Signals) -> Decision:
            d = super().update(s)
            return d if s.now % 2 == 0 else Decision(d.window, d.branch, None, Coalesce(0.3, 99))

    t = [0.0]
    gate = Gate(4, clock=lambda: t[0])
    ctl = Controller(gate, Every(), lambda: CacheStats(0.5, 1_000_000), 1.0, clock=lambda: t[0])
    seen = []
    for i in range(4):
        t[0] = float(i)
        line = ctl.step()
        seen.append((gate._hold_seconds, gate._hold_tokens, line.get("coalesce_s")))
    assert seen == [(0.0, 0, None), (0.3, 99, 0.3), (0.0, 0, None), (0.3, 99, 0.3)]
    s = ctl.summary()
    assert s["coalescing_periods"] == 2 and s["holds"] == 0
    assert "holds" not in Controller(gate, WorkingSet2(), lambda: CacheStats(0.5), 1.0).summary()


def test_when_the_first_held_is_cancelled_the_hold_runs_from_the_next():
    async def main():
        gate, log = await holders("ABC", 100)
        gate.coalesce(1.0, 10_000)
        a = asyncio.create_task(step(gate, "A", 200, log))
        await asyncio.sleep(0.4)
        b = asyncio.create_task(step(gate, "B", 200, log))
        await asyncio.sleep(0.1)
        a.cancel()
        await asyncio.gather(a, b, return_exceptions=True)
        assert log == [(1.4, "B")]

    run_virtual(main())


def test_the_request_rate_is_the_mean_of_the_last_ten_periods():
    from runner.gate.control import RATE_PERIODS

    seen: list[float | None] = []

    class Spy(WorkingSet2):
        def update(self, s: Signals) -> Decision:
            seen.append(s.requests_per_second)
            return super().update(s)

    t = [0.0]
    ctl = Controller(Gate(4, clock=lambda: t[0]), Spy(), lambda: CacheStats(0.5), 2.0,
                     clock=lambda: t[0])  # fmt: skip
    for i in range(RATE_PERIODS + 2):
        for _ in range(i):  # i requests finished in period i
            ctl.record(100, 50, 10)
        t[0] += 2.0
        ctl.step()
    assert seen[: RATE_PERIODS - 1] == [None] * (RATE_PERIODS - 1)  # a burst decides nothing
    assert seen[RATE_PERIODS - 1 :] == [
        sum(range(k - RATE_PERIODS + 1, k + 1)) / (RATE_PERIODS * 2.0)
        for k in range(RATE_PERIODS - 1, RATE_PERIODS + 2)
    ]


def test_gates_summed_over_ranks_and_workers_keep_the_policys_own_counts():
    from runner.gate.control import policy_sums
    from runner.scaleout.summary import merged_gate

    a = {"pauses": 1, "orders": {"least-waited/most-waited": 3}, "coalescing_periods": 2,
         "holds": 5, "agent_seconds_held": 0.5}  # fmt: skip
    b = {"pauses": 2, "coalescing_periods": 1, "holds": 4, "agent_seconds_held": 0.25}
    assert policy_sums([a, b]) == {
        "orders": {"least-waited/most-waited": 3},
        "coalescing_periods": 3,
        "holds": 9,
        "agent_seconds_held": 0.75,
    }
    assert policy_sums([{"pauses": 1}, {"pauses": 2}]) == {}  # nothing chosen: nothing added
    merged = merged_gate([b, a])
    assert merged is not None and merged["holds"] == 9 and merged["orders"] == a["orders"]
