"""One gate window per data-parallel rank.

With SGLang's `--dp N`, every rank has its own KV pool and prefix cache, and an agent must
stay on one rank for its whole life or lose its prefix at every turn. So each rank gets its
own `Gate` (and its own controller and signals), and a lobby in front of them holds the agents
that have no rank yet: when a rank has room (holders plus its own waiters below its window),
the lobby sends it the next agent in task order, and the agent stays there until it ends.
`bind` tells the engine which rank the agent was given.

The per-rank gates are unchanged `Gate`s: every rule of gate.py holds on each rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .gate import Gate, GateCounters
from .gate_order import ContextsView
from .tool_calls import ToolsView


class RankedGate:
    def __init__(self, gates: list[Gate], bind: Callable[[str, int], object]) -> None:
        if not gates:
            raise ValueError("RankedGate needs at least one rank")
        self.gates = gates
        self._bind = bind
        self.rank: dict[str, int] = {}
        self._lobby: dict[str, asyncio.Future[int] | None] = {}  # insertion = task order
        self.unit = gates[0].unit

    def rank_of(self, key: str) -> int | None:
        """The rank `key` was sent to; None while it waits in the lobby (or is unknown)."""
        return self.rank.get(key)

    # ---- the Gate surface the agent loop and the batch use --------------------------------

    def register(self, key: str) -> None:
        if key not in self.rank and key not in self._lobby:
            self._lobby[key] = None

    async def acquire(self, key: str, context_tokens: int = 0) -> None:
        r = self.rank.get(key)
        if r is None:
            self.register(key)
            fut = asyncio.get_running_loop().create_future()
            self._lobby[key] = fut
            self._dispatch()
            try:
                r = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # sent to a rank just now: leave it
                    self.gates[fut.result()].finish(key)
                self._lobby.pop(key, None)
                raise
        await self.gates[r].acquire(key, context_tokens)

    def done_request(self, key: str) -> None:
        r = self.rank.get(key)
        if r is not None:
            self.gates[r].done_request(key)
            self._dispatch()

    def finish(self, key: str) -> None:
        r = self.rank.get(key)
        if r is None:
            fut = self._lobby.pop(key, None)
            if fut is not None and not fut.done():
                fut.cancel()
            return
        self.gates[r].finish(key)
        self._dispatch()

    def state(self, key: str) -> str:
        r = self.rank.get(key)
        return "pending" if r is None else self.gates[r].state(key)

    # ---- what the controllers use ---------------------------------------------------------

    def resize(self, rank: int, window: int) -> int:
        g = self.gates[rank]
        # the lobby's agents may still come to this rank: they count toward its bound
        bound = g.counts()["unfinished"] + len(self._lobby)
        w = g.resize(window, bound=bound)
        self._dispatch()
        return w

    def view(self, rank: int) -> RankView:
        return RankView(self, rank)

    def counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for g in self.gates:
            for k, v in g.counts().items():
                total[k] = total.get(k, 0) + v
        total["pending"] = total.get("pending", 0) + len(self._lobby)
        total["unfinished"] = total.get("unfinished", 0) + len(self._lobby)
        return total

    @property
    def window(self) -> int:
        return sum(g.window for g in self.gates)

    # ---- mechanism ------------------------------------------------------------------------

    @staticmethod
    def _room(g: Gate) -> int:
        return g.window - g.holders() - g.waiting()

    def _dispatch(self) -> None:
        if not self._lobby or max(self._room(g) for g in self.gates) <= 0:
            return  # no rank has room (most calls): the lobby is not scanned
        waiting = [k for k, f in self._lobby.items() if f is not None and not f.done()]
        for key in waiting:
            r = max(range(len(self.gates)), key=lambda i: (self._room(self.gates[i]), -i))
            if self._room(self.gates[r]) <= 0:
                return
            fut = self._lobby.pop(key)
            self.rank[key] = r
            self.gates[r].register(key)
            self._bind(key, r)
            assert fut is not None
            fut.set_result(r)


class RankView:
    """One rank's gate as its controller sees it (a ControlledGate): resizing goes through the
    RankedGate (for the bound and the lobby); everything else is the rank's own Gate."""

    def __init__(self, ranked: RankedGate, rank: int) -> None:
        self._ranked, self._rank = ranked, rank
        self._gate = ranked.gates[rank]
        self.pause_rule = self._gate.pause_rule
        self.resume_rule = self._gate.resume_rule

    @property
    def counters(self) -> GateCounters:
        return self._gate.counters

    @property
    def window(self) -> int:
        return self._gate.window

    def resize(self, window: int) -> int:
        return self._ranked.resize(self._rank, window)

    def use_rules(self, rules: tuple[str, str] | None) -> None:
        self._gate.use_rules(rules)

    def coalesce(self, seconds: float, tokens: int) -> None:
        self._gate.coalesce(seconds, tokens)

    def counts(self) -> dict[str, int]:
        return self._gate.counts()

    def contexts(self) -> ContextsView:
        return self._gate.contexts()

    def tools(self) -> ToolsView:
        return self._gate.tools()

    def growth_per_step(self) -> float | None:
        return self._gate.growth_per_step()

    def drain_events(self) -> list[tuple[str, str]]:
        return self._gate.drain_events()

    def wait_totals(self) -> tuple[float, float]:
        return self._gate.wait_totals()
