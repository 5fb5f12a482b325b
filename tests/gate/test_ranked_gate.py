"""Data parallelism: one window per rank, agents stick to a rank (test double engine)."""

import asyncio

from runner.engines.protocol import CacheStats
from runner.gate.control import Controller, MultiController
from runner.gate.gate import Gate
from runner.gate.ranked_gate import RankedGate
from runner.policies.aimd import AIMD
from runner.sim.vclock import run_virtual
from tests.gate.test_gate import agent  # the same agent-shaped coroutine, over a RankedGate


class FakeDPEngine:
    """Test double of a data-parallel engine: per-rank usage set by the test, and a record
    of every rank binding and of which rank served each request."""

    def __init__(self, ranks):
        self.usage = [0.1] * ranks
        self.bound: dict[str, int] = {}
        self.served: list[tuple[str, int]] = []
        self.in_flight = [0] * ranks
        self.max_in_flight = [0] * ranks

    def assign_rank(self, key, rank):
        assert key not in self.bound, f"{key} bound twice"
        self.bound[key] = rank

    def rank_stats(self, r):
        return CacheStats(self.usage[r], capacity_tokens=1000)

    async def generate(self, key, seconds):
        r = self.bound[key]
        self.served.append((key, r))
        self.in_flight[r] += 1
        self.max_in_flight[r] = max(self.max_in_flight[r], self.in_flight[r])
        await asyncio.sleep(seconds)
        self.in_flight[r] -= 1


def make(ranks, window):
    eng = FakeDPEngine(ranks)
    ranked = RankedGate([Gate(window) for _ in range(ranks)], bind=eng.assign_rank)
    ctl = MultiController(
        ranked,
        [
            Controller(ranked.view(r), AIMD(), lambda r=r: eng.rank_stats(r), 1.0, rank=r)
            for r in range(ranks)
        ],
    )
    return eng, ranked, ctl


def test_agents_stick_to_one_rank_and_each_rank_keeps_its_window():
    async def main():
        eng, ranked, _ctl = make(2, 2)
        keys = [f"a{i}" for i in range(10)]
        for k in keys:
            ranked.register(k)
        await asyncio.gather(*(agent(ranked, eng, k, 3, 1.0, 2.0) for k in keys))
        return eng, ranked

    eng, ranked = run_virtual(main())
    assert set(eng.bound) == {f"a{i}" for i in range(10)}
    for key, r in eng.served:
        assert eng.bound[key] == r  # every request of an agent went to its own rank
    assert max(eng.max_in_flight) <= 2  # window 2 per rank, agent unit
    assert sorted(ranked.rank.values()).count(0) >= 3 and sorted(ranked.rank.values()).count(1) >= 3


def test_first_agents_fill_the_rank_with_room():
    async def main():
        eng, ranked, _ = make(2, 1)
        for k in "ABC":
            ranked.register(k)
        a = asyncio.create_task(ranked.acquire("A"))
        b = asyncio.create_task(ranked.acquire("B"))
        c = asyncio.create_task(ranked.acquire("C"))
        await asyncio.gather(a, b)
        await asyncio.sleep(0)
        assert (eng.bound["A"], eng.bound["B"]) == (0, 1)
        assert "C" not in eng.bound and not c.done()  # both ranks full: C waits in the lobby
        ranked.finish("B")
        await c
        return eng

    eng = run_virtual(main())
    assert eng.bound["C"] == 1  # B's rank had room


def test_each_rank_follows_its_own_signals(tmp_path):
    async def main():
        eng, ranked, ctl = make(2, 4)
        keys = [f"a{i}" for i in range(16)]
        for k in keys:
            ranked.register(k)
        waiters = [asyncio.create_task(ranked.acquire(k)) for k in keys]
        await asyncio.sleep(0)
        eng.usage = [0.9, 0.05]  # rank 0 thrashing, rank 1 nearly empty
        for c in ctl.controllers:
            c.record(1000, 100)  # H = 0.1 on both
        lines = ctl.step()
        for w in waiters:
            w.cancel()
        return lines, ctl

    lines, ctl = run_virtual(main())
    assert [(x["rank"], x["branch"], x["w_after"]) for x in lines] == [
        (0, "decrease", 2),
        (1, "increase", 6),
    ]
    s = ctl.summary()
    assert s["dp_ranks"] == 2 and s["window"]["max"] == 8
