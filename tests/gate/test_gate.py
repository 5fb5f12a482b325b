"""Gate semantics on virtual time, with a test-double engine that only models request time."""

import asyncio
import itertools
import random

import pytest

from runner.engines.protocol import CacheStats
from runner.gate.control import Controller
from runner.gate.gate import Gate
from runner.policies.aimd import AIMD
from runner.policies.registry import make_policy
from runner.runfolder.store import RunStore
from runner.sim.vclock import run_virtual


class FakeEngine:
    """Test double: a request takes `seconds`; tracks what is in flight and cancellations."""

    def __init__(self):
        self.in_flight: set[str] = set()
        self.cancelled = 0
        self.started: list[tuple[float, str]] = []

    async def generate(self, key: str, seconds: float) -> None:
        self.in_flight.add(key)
        self.started.append((asyncio.get_running_loop().time(), key))
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight.discard(key)


async def agent(gate, eng, key, steps, gen, tool):
    try:
        for _ in range(steps):
            await gate.acquire(key)
            try:
                await eng.generate(key, gen)
            finally:
                gate.done_request(key)
            await asyncio.sleep(tool)
    finally:
        gate.finish(key)


def now():
    return asyncio.get_running_loop().time()


def test_admitted_agents_in_tools_keep_third_waiting():
    async def main():
        gate, eng = Gate(2), FakeEngine()
        for k in "ABC":
            gate.register(k)
        tasks = [asyncio.create_task(agent(gate, eng, k, 2, 1.0, 10.0)) for k in "ABC"]
        await asyncio.sleep(5)  # A and B are in their tools, holding their slots
        assert eng.in_flight == set()
        assert gate.counts()["active"] == 2 and gate.counts()["pending"] == 1
        assert [k for _, k in eng.started] == ["A", "B"]
        await asyncio.gather(*tasks)
        # C started only when A finished (after 2 steps: 1 + 10 + 1 + 10 = 22 s)
        assert next((t, k) for t, k in eng.started if k == "C") == (22.0, "C")

    run_virtual(main())


def test_shrink_never_cancels_and_pauses_at_boundary():
    async def main():
        gate, eng = Gate(3), FakeEngine()
        for k in "ABC":
            gate.register(k)
        tasks = [asyncio.create_task(agent(gate, eng, k, 3, 4.0, 1.0)) for k in "ABC"]
        await asyncio.sleep(1)
        assert eng.in_flight == {"A", "B", "C"}
        assert gate.resize(1) == 1
        c = gate.counts()
        assert c["active"] == 1 and c["paused"] == 2  # marked, still running their request
        assert eng.in_flight == {"A", "B", "C"} and eng.cancelled == 0
        await asyncio.sleep(3.5)  # requests done at t=4, tools until t=5: boundary not reached
        assert gate.counters.pauses == 0
        await asyncio.sleep(1)  # t=5.5: B and C reached their next boundary and stopped
        assert gate.counters.pauses == 2
        assert eng.in_flight == {"A"}
        await asyncio.gather(*tasks)
        assert eng.cancelled == 0
        # after the shrink, at most one request at a time
        late = sorted(t for t, _ in eng.started if t > 1)
        assert all(b - a >= 4.0 for a, b in itertools.pairwise(late))
        # most recently admitted (C, then B) were the ones paused
        assert gate.counters.resumes == 2

    run_virtual(main())


def test_finishing_agent_lets_next_in():
    async def main():
        gate, eng = Gate(1), FakeEngine()
        for k in "AB":
            gate.register(k)
        a = asyncio.create_task(agent(gate, eng, "A", 1, 2.0, 3.0))
        b = asyncio.create_task(agent(gate, eng, "B", 1, 2.0, 3.0))
        await asyncio.gather(a, b)
        assert eng.started == [(0.0, "A"), (5.0, "B")]

    run_virtual(main())


def test_request_cap_admits_while_agents_sit_in_tools():
    async def main():
        gate, eng = Gate(1, unit="request"), FakeEngine()
        for k in "AB":
            gate.register(k)
        ts = [asyncio.create_task(agent(gate, eng, k, 2, 1.0, 10.0)) for k in "AB"]
        await asyncio.gather(*ts)
        assert eng.started == [(0.0, "A"), (1.0, "B"), (11.0, "A"), (12.0, "B")]

    run_virtual(main())


def test_grow_unmarks_then_resumes_then_admits():
    async def main():
        gate, eng = Gate(2), FakeEngine()
        for k in "ABCD":
            gate.register(k)
        ts = [asyncio.create_task(agent(gate, eng, k, 2, 5.0, 1.0)) for k in "ABCD"]
        await asyncio.sleep(1)
        gate.resize(1)  # B marked (newest admitted)
        assert gate.counts()["paused"] == 1
        gate.resize(4)  # B unmarked first; C, D admitted
        await asyncio.sleep(0)
        assert gate.counts()["paused"] == 0
        assert gate.counts()["active"] == 4
        await asyncio.gather(*ts)
        assert gate.counters.pauses == 0

    run_virtual(main())


def test_window_bounds():
    async def main():
        gate = Gate(5)
        for k in "AB":
            gate.register(k)
        assert gate.resize(0) == 1
        assert gate.resize(100) == 2  # never above the unfinished agents
        gate.finish("A")
        gate.finish("B")
        assert gate.resize(3) == 1

    run_virtual(main())


def test_cancelled_waiter_passes_slot_on():
    async def main():
        gate, eng = Gate(1), FakeEngine()
        for k in "ABC":
            gate.register(k)
        a = asyncio.create_task(agent(gate, eng, "A", 1, 1.0, 0.0))
        b = asyncio.create_task(agent(gate, eng, "B", 1, 1.0, 0.0))
        c = asyncio.create_task(agent(gate, eng, "C", 1, 1.0, 0.0))
        await asyncio.sleep(0.5)
        b.cancel()
        await asyncio.gather(a, c, return_exceptions=False)
        with pytest.raises(asyncio.CancelledError):
            await b
        assert [k for _, k in eng.started] == ["A", "C"]

    run_virtual(main())


def test_waiters_get_slots_in_the_order_the_policy_reads():
    # B is paused, its wait is cancelled, and it comes back with a shorter context: under
    # "longest" it now waits behind C, as contexts() shows the policy, and C is resumed first
    async def main():
        gate = Gate(3, resume_rule="longest")
        for k, ctx in (("A", 100), ("B", 200), ("C", 300)):
            await gate.acquire(k, ctx)
        gate.resize(1)  # marks C and B (newest first)
        b = asyncio.ensure_future(gate.acquire("B", 500))
        c = asyncio.ensure_future(gate.acquire("C", 300))
        await asyncio.sleep(0)  # both paused: B (500) before C (300)
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)
        b = asyncio.ensure_future(gate.acquire("B", 100))
        await asyncio.sleep(0)
        assert tuple(gate.contexts()) == (100, 300, 100)  # A holds; C, then B, wait
        gate.drain_events()
        gate.resize(2)
        assert gate.drain_events() == [("resumed", "C")]
        gate.resize(3)
        await asyncio.gather(b, c)

    run_virtual(main())


def test_pause_rules_select_deterministically():
    async def main():
        for rule, expected in (
            ("newest", {"C", "D"}),
            ("shortest", {"A", "B"}),
            ("longest", {"C", "D"}),
        ):
            gate = Gate(4, pause_rule=rule)
            waiters = []
            for i, k in enumerate("ABCD"):
                gate.register(k)
                waiters.append(asyncio.create_task(gate.acquire(k, context_tokens=100 * (i + 1))))
            await asyncio.gather(*waiters)
            gate.resize(2)
            assert {e[1] for e in gate.drain_events() if e[0] == "marked"} == expected, rule

    run_virtual(main())


def test_bad_rules_rejected():
    with pytest.raises(ValueError, match="pause rule"):
        Gate(1, pause_rule="random")
    with pytest.raises(ValueError, match="resume rule"):
        Gate(1, resume_rule="random")


def test_controller_logs_and_resizes(tmp_path):
    async def main():
        gate = Gate(4)
        for k in "ABCDEF":
            gate.register(k)
        usage = iter([0.65, 0.45, 0.18])
        store = RunStore(tmp_path)
        ctl = Controller(
            gate, AIMD(), lambda: CacheStats(next(usage)), 1.0, on_line=store.log_control
        )
        ctl.record(100, 15)
        l1 = await ctl.tick()
        ctl.record(100, 82)
        l2 = await ctl.tick()
        l3 = await ctl.tick()  # no request finished: H unknown
        return l1, l2, l3, ctl

    l1, l2, l3, ctl = run_virtual(main())
    assert (l1["w_before"], l1["w_after"], l1["branch"], l1["h"]) == (4, 2, "decrease", 0.15)
    assert (l2["w_after"], l2["branch"]) == (2, "hold")
    assert (l3["w_after"], l3["branch"], l3["h"]) == (4, "increase", None)
    lines = (tmp_path / "control.jsonl").read_text().splitlines()
    assert len(lines) == 3
    s = ctl.summary()
    assert s["window"] == {"min": 2, "mean": 3.0, "max": 4} and s["policy"] == "aimd"


def test_stress_2000_agents_moving_window():
    rng = random.Random(1234)
    n = 2000

    async def main():
        gate, eng = Gate(50), FakeEngine()
        violations = []
        orig_fill = gate._fill

        def checked_fill():
            orig_fill()
            unmarked = gate.counts()["active"]
            if unmarked > gate.window:
                violations.append((now(), unmarked, gate.window))
            if len(eng.in_flight) > gate.holders():
                violations.append(("in-flight beyond holders", len(eng.in_flight)))

        gate._fill = checked_fill
        keys = [f"a{i}" for i in range(n)]
        for k in keys:
            gate.register(k)
        admitted = set()
        orig_grant = gate._grant

        def grant(a, now):
            admitted.add(a.key)
            orig_grant(a, now)

        gate._grant = grant

        async def controller():
            while True:
                await asyncio.sleep(1.0)
                gate.resize(rng.randint(1, 300))
                if gate.counts()["active"] > gate.window:
                    violations.append(("after resize", gate.window))

        ctl = asyncio.create_task(controller())
        await asyncio.gather(
            *(
                agent(gate, eng, k, rng.randint(1, 8), rng.uniform(0.05, 2.0), rng.uniform(0, 5.0))
                for k in keys
            )
        )
        ctl.cancel()
        return gate, violations, admitted

    gate, violations, admitted = run_virtual(main())  # a deadlock raises vclock.Deadlock
    assert violations == []
    assert admitted == {f"a{i}" for i in range(n)}  # nobody starved
    assert gate.counts()["finished"] == n
    assert gate.counters.pauses > 0 and gate.counters.resumes == gate.counters.pauses


def test_contexts_and_growth_signals(tmp_path):
    async def main():
        gate = Gate(2, resume_rule="newest")
        for k in "ABCD":
            gate.register(k)
        a = asyncio.create_task(gate.acquire("A", 100))
        b = asyncio.create_task(gate.acquire("B", 200))
        await asyncio.gather(a, b)
        c = asyncio.create_task(gate.acquire("C", 300))
        d = asyncio.create_task(gate.acquire("D", 400))
        await asyncio.sleep(0)
        view = gate.contexts()  # holders in keep order, then waiters in admission order
        assert (tuple(view), view.held, view.total(3)) == ((100, 200, 300, 400), 2, 600)
        await gate.acquire("A", 160)  # A's next step: +60
        assert gate.growth_per_step() == 60
        gate.finish("A")
        gate.finish("B")
        await asyncio.gather(c, d)
        ctl = Controller(gate, make_policy("wset"), lambda: CacheStats(0.1, 1000), 1.0)
        ctl.record(500, 0, 500)  # a first request: nothing cached
        ctl.record(520, 300, 520)  # another agent's first request found 300 shared tokens
        ctl.record(700, 200, 150)  # 700 - 200 cached - 150 fresh = 350 recomputed
        line = ctl.step()
        return line, ctl

    line, _ctl = run_virtual(main())
    assert line["recompute"] == round(350 / 1720, 4)
    assert line["branch"] == "fit"


async def test_a_control_line_lists_the_agents_admitted_paused_and_resumed_in_order():
    gate = Gate(4)
    for k in ("a0", "a1", "a2", "a3"):
        await gate.acquire(k, 1000)
    ctl = Controller(gate, make_policy("agent-cap:2"), lambda: CacheStats(0.1), 1.0, lambda: 0.0)
    line = ctl.step()  # marks the two admitted last, newest first
    assert line["admitted"] == ["a0", "a1", "a2", "a3"]
    assert (line["paused_ids"], line["resumed"]) == (["a3", "a2"], [])
    # a3 reaches its step boundary: it pauses there (listed in the next line) and waits
    waiting = asyncio.ensure_future(gate.acquire("a3", 1200))
    await asyncio.sleep(0)
    ctl.policy = make_policy("agent-cap:4")
    line = ctl.step()  # unmarks a2, resumes a3
    assert (line["admitted"], line["paused_ids"], line["resumed"]) == ([], ["a3"], ["a2", "a3"])
    await waiting


@pytest.mark.parametrize("shares", [True, False])
async def test_the_shared_prefix_signal_counts_only_a_prefix_the_engine_stores_once(shares):
    # agents' first requests found 300 tokens cached; on llama.cpp that prefix is copied into
    # each stream, so a policy fitting contexts to the pool must count it in each
    seen = []

    class Probe:  # a policy that records what it reads (a test double of the protocol)
        name, unit, wants_contexts, wants_tools = "probe", "agent", False, False

        def initial_window(self, n):
            return n

        def update(self, s):
            seen.append(s)
            return AIMD().update(s)

        def params(self):
            return {}

    gate = Gate(2)
    stats = CacheStats(0.1, 1000, shares_prefixes=shares)
    ctl = Controller(gate, Probe(), lambda: stats, 1.0, lambda: 0.0)
    ctl.record(500, 300, 500)
    ctl.record(520, 300, 520)
    ctl.step()
    assert seen[0].shared_tokens == (300 if shares else 0)
