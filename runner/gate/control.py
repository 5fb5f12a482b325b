"""The monitor: every control period, read the engine's signals, ask the policy, resize the gate,
and hand one line to the run folder's writer (control.jsonl).

H_t is sum(cached prompt tokens) / sum(prompt tokens) over the requests that FINISHED in the
period. When none finished, H_t is None ("no evidence"): it is logged as null, and AIMD
cannot take its decrease branch on it (a cut needs measured thrashing).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import statistics
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..engines.protocol import CacheStats
from ..policies.protocol import ContextList, Policy, Signals, ToolList
from .gate import ControlledGate
from .ranked_gate import RankedGate

log = logging.getLogger("concur")
DEFAULT_CONTROL_PERIOD = 2.0  # seconds; the paper does not give its period
# Signals.requests_per_second is taken over this many periods: a rate that lasts, not the
# burst of agents back from tools that began together (at the start of a run)
RATE_PERIODS = 10


@dataclass
class PeriodTally:
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    recomputed: int = 0  # prompt tokens the engine had seen before but no longer had cached

    def hit_rate(self) -> float | None:
        return self.cached / self.prompt if self.prompt else None

    def recompute_rate(self) -> float | None:
        return self.recomputed / self.prompt if self.prompt else None


@dataclass
class ControlStats:
    windows: list[int] = field(default_factory=list)
    periods: int = 0
    branches: dict[str, int] = field(default_factory=dict)  # how often each branch fired
    orders: dict[str, int] = field(default_factory=dict)  # periods under a policy's own order
    coalescing: int = 0  # periods with requests coalesced (Decision.coalesce)
    last: dict[str, Any] = field(default_factory=dict)  # the latest control line (progress)


def _by_kind(events: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The period's agents admitted, paused (marked or paused) and resumed (resumed or
    unmarked), in the order they happened: one pass (a period may resize by thousands)."""
    admitted: list[str] = []
    paused: list[str] = []
    resumed: list[str] = []
    add = {
        "admitted": admitted.append,
        "marked": paused.append,
        "paused": paused.append,
        "resumed": resumed.append,
        "unmarked": resumed.append,
    }
    for what, key in events:
        put = add.get(what)
        if put is not None:
            put(key)
    return {"admitted": admitted, "paused_ids": paused, "resumed": resumed}


class Controller:
    def __init__(
        self,
        gate: ControlledGate,
        policy: Policy,
        read_signals: Callable[[], CacheStats],
        period: float,
        clock: Callable[[], float] | None = None,
        rank: int | None = None,
        on_line: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        if period <= 0:
            raise ValueError(f"--control-period must be > 0 seconds, got {period!r}")
        self.gate = gate
        self.policy = policy
        self.read_signals = read_signals
        self.period = period
        self.on_line = on_line  # awaited with each period's line (the run folder's writer)
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self.rank = rank  # the data-parallel rank this controller steers, if any
        self._tally = PeriodTally()
        self._requests: deque[int] = deque(maxlen=RATE_PERIODS)  # per period, the latest
        self._first_cached: list[int] = []  # sorted: its median is read every period
        self._t0: float | None = None
        self.stats = ControlStats(windows=[gate.window])

    def record(
        self, prompt_tokens: int, cached_tokens: int, fresh_tokens: int = 0, agent: str = ""
    ) -> None:
        """A request finished (called by the agent loop). `fresh_tokens`: the part of the
        prompt the engine had never been sent (the first prompt, then each new turn)."""
        self._tally.requests += 1
        self._tally.prompt += prompt_tokens
        self._tally.cached += cached_tokens
        self._tally.recomputed += max(0, prompt_tokens - cached_tokens - fresh_tokens)
        if fresh_tokens >= prompt_tokens and len(self._first_cached) < 1000:
            # an agent's first request: what it found cached is the prefix agents share
            bisect.insort(self._first_cached, cached_tokens)

    def _rate(self, requests: int) -> float | None:
        """Requests finished per second over the last RATE_PERIODS periods, this one's
        `requests` included (None until that many have passed)."""
        self._requests.append(requests)
        if len(self._requests) < RATE_PERIODS:
            return None
        return sum(self._requests) / (RATE_PERIODS * self.period)

    def step(self) -> dict[str, Any]:
        """One control period: signals -> policy -> gate. Returns the period's line (`tick`
        hands it to `on_line`)."""
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        cache = self.read_signals()
        tally, self._tally = self._tally, PeriodTally()
        c = self.gate.counts()
        before = self.gate.window
        contexts = self.gate.contexts() if self.policy.wants_contexts else ContextList()
        tools = self.gate.tools() if self.policy.wants_tools else ToolList()
        sig = Signals(
            now=now,
            window=before,
            usage=cache.usage,
            hit_rate=tally.hit_rate(),
            active=c["active"],
            paused=c["paused"],
            pending=c["pending"],
            finished=c["finished"],
            unfinished=c["unfinished"],
            capacity_tokens=cache.capacity_tokens,
            resident_limit=cache.resident_limit,
            host_capacity_tokens=cache.host_capacity_tokens,
            host_reload_cost=cache.host_reload_cost,
            contexts=contexts,
            tools=tools,
            recompute_token_seconds=cache.recompute_token_seconds,
            host_reload_token_seconds=cache.host_reload_token_seconds,
            period_seconds=self.period,
            growth_per_step=self.gate.growth_per_step(),
            recompute_rate=tally.recompute_rate(),
            shared_tokens=self._shared_tokens() if cache.shares_prefixes else 0,
            requests_per_second=self._rate(tally.requests),
        )
        decision = self.policy.update(sig)
        order, hold = decision.order, decision.coalesce
        self.gate.use_rules(None if order is None else (order.pause, order.resume))
        if hold is None:
            self.gate.coalesce(0.0, 0)
        else:
            self.gate.coalesce(hold.seconds, hold.tokens)
        after = self.gate.resize(decision.window)
        c = self.gate.counts()
        events = self.gate.drain_events()
        named = None if order is None else str(order)
        line = {
            "t": round(now - self._t0, 3),
            **({"rank": self.rank} if self.rank is not None else {}),
            "w_before": before,
            "w_after": after,
            "u": cache.usage,
            "h": sig.hit_rate,
            "branch": decision.branch,
            **({"order": named} if named is not None else {}),
            **({"coalesce_s": hold.seconds} if hold is not None else {}),
            "recompute": None if sig.recompute_rate is None else round(sig.recompute_rate, 4),
            "requests": tally.requests,
            "active": c["active"],
            "paused": c["paused"],
            "pending": c["pending"],
            "finished": c["finished"],
            **_by_kind(events),
        }
        self.stats.windows.append(after)
        self.stats.periods += 1
        self.stats.branches[decision.branch] = self.stats.branches.get(decision.branch, 0) + 1
        if named is not None:
            self.stats.orders[named] = self.stats.orders.get(named, 0) + 1
        self.stats.coalescing += hold is not None
        self.stats.last = line
        return line

    async def tick(self) -> dict[str, Any] | None:
        """One period, its line handed to `on_line` and returned (None: the period failed).
        A failing period (an engine that cannot report its signals, a policy bug) is logged
        and the window kept: that must never take the batch down. A line that cannot be
        written (a full disk) is raised: the run folder is failing, and the batch stops on it
        as on any other record it cannot write."""
        try:
            line = self.step()
        except Exception:
            rank = "" if self.rank is None else f" of DP rank {self.rank}"
            log.exception("control period%s failed; the window stays at %d", rank, self.gate.window)
            return None
        if self.on_line is not None:
            await self.on_line(line)
        return line

    def _shared_tokens(self) -> int | None:
        """The median (low) of what agents' first requests found cached."""
        first = self._first_cached
        return first[(len(first) - 1) // 2] if first else None

    async def run(self) -> None:
        """Runs until cancelled (or the run folder fails: see tick)."""
        while True:
            await asyncio.sleep(self.period)
            await self.tick()

    def summary(self) -> dict[str, Any]:
        w = self.stats.windows
        paused_s, pending_s = self.gate.wait_totals()
        return {
            "policy": self.policy.name,
            "policy_params": self.policy.params(),
            "unit": self.policy.unit,
            "pause_rule": self.gate.pause_rule,
            "resume_rule": self.gate.resume_rule,
            "control_period_s": self.period,
            "control_periods": self.stats.periods,
            "branches": self.stats.branches,
            # periods a policy chose its own pause/resume order, by order (only if any)
            **({"orders": self.stats.orders} if self.stats.orders else {}),
            "window": {"min": min(w), "mean": round(statistics.fmean(w), 3), "max": max(w)},
            "pauses": self.gate.counters.pauses,
            "resumes": self.gate.counters.resumes,
            "agent_seconds_paused": round(paused_s, 3),
            "agent_seconds_pending": round(pending_s, 3),
            # requests held back to be sent together, and for how long (only if any period
            # coalesced)
            **(
                {
                    "coalescing_periods": self.stats.coalescing,
                    "holds": self.gate.counters.holds,
                    "agent_seconds_held": round(self.gate.counters.hold_seconds, 3),
                }
                if self.stats.coalescing
                else {}
            ),
        }


HOLD_SUMS = ("coalescing_periods", "holds", "agent_seconds_held")


def policy_sums(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Over several gates' summaries (DP ranks, workers): the counts a policy's own choices
    add, where any of them has them (`orders` by order, the coalescing counts), summed."""
    out: dict[str, Any] = {}
    orders: dict[str, int] = {}
    for s in summaries:
        for order, n in s.get("orders", {}).items():
            orders[order] = orders.get(order, 0) + n
    if orders:
        out["orders"] = orders
    if any("holds" in s for s in summaries):
        out.update({k: round(sum(s.get(k, 0) for s in summaries), 3) for k in HOLD_SUMS})
    return out


class MultiController:
    """One Controller per data-parallel rank (ranked_gate.py), stepped together: each rank's
    window follows its own U and H. Same surface as Controller."""

    def __init__(self, ranked: RankedGate, controllers: list[Controller]) -> None:
        self.ranked = ranked
        self.controllers = controllers
        self.period = controllers[0].period
        self.policy = controllers[0].policy

    @property
    def stats(self) -> ControlStats:
        return self.controllers[0].stats

    def record(
        self, prompt_tokens: int, cached_tokens: int, fresh_tokens: int = 0, agent: str = ""
    ) -> None:
        rank = self.ranked.rank_of(agent) or 0
        self.controllers[rank].record(prompt_tokens, cached_tokens, fresh_tokens)

    def step(self) -> list[dict[str, Any]]:
        return [c.step() for c in self.controllers]

    async def tick(self) -> None:
        for c in self.controllers:
            await c.tick()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            await self.tick()

    def summary(self) -> dict[str, Any]:
        ranks = [c.summary() for c in self.controllers]
        totals = [sum(w) for w in zip(*(c.stats.windows for c in self.controllers), strict=False)]
        out = dict(ranks[0])
        out.update(
            window={
                "min": min(totals),
                "mean": round(statistics.fmean(totals), 3),
                "max": max(totals),
            },
            pauses=sum(r["pauses"] for r in ranks),
            resumes=sum(r["resumes"] for r in ranks),
            agent_seconds_paused=round(sum(r["agent_seconds_paused"] for r in ranks), 3),
            agent_seconds_pending=round(sum(r["agent_seconds_pending"] for r in ranks), 3),
            **policy_sums(ranks),
            dp_ranks=len(ranks),
            ranks=ranks,
        )
        return out
