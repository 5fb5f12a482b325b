"""The agent-level admission gate: mechanism only (the policy decides the window).

Every agent calls `acquire(agent)` before each generation and `done_request(agent)` after it,
and `finish(agent)` when it ends. A slot is held for a whole agent life (policy unit "agent")
or for one request (unit "request").

States of an agent, agent unit:

    pending --admit--> active --resize below--> marked --next acquire--> paused
       ^                 |  ^                      |                       |
       |                 |  +------unmark----------+                       |
       |               finish                      +--------resume---------+
    (registered)         v
                       done

- `active` and `marked` agents hold a slot; a marked agent still finishes the request it has
  in the engine (requests are never cancelled) and stops at its next step boundary, i.e. its
  next `acquire`, where it gives its slot up and waits as `paused`.
- Invariant: (slot holders not marked) <= W at every instant, and new slots are granted only
  while all holders, marked included, are below W (a marked agent's KV is still in use).
- Growing W unmarks marked agents first (their cache is warm), then resumes paused agents,
  then admits pending ones, each in the order the chosen rules give.
- Waiting is a future per agent; a slot granted to a waiter that got cancelled is passed on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

PauseRule = Literal["newest", "shortest", "longest"]
ResumeRule = Literal["oldest", "longest", "shortest"]
PAUSE_RULES: dict[str, str] = {
    "newest": "pause the most recently admitted agents first (LIFO; default)",
    "shortest": "pause the agents with the shortest context first (cheapest to recompute)",
    "longest": "pause the agents with the longest context first (frees the most KV)",
}
RESUME_RULES: dict[str, str] = {
    "oldest": "resume the agent paused longest ago first (FIFO; default)",
    "longest": "resume the agent with the longest context first",
    "shortest": "resume the agent with the shortest context first",
}


@dataclass
class _Agent:
    key: str
    order: int  # registration order: pending agents are admitted FIFO in it
    state: str = "pending"  # pending | active | marked | paused | idle | done
    admitted_seq: int = -1  # when it last got a slot (for the "newest" pause rule)
    context: int = 0  # tokens in its context, as last reported
    waiter: asyncio.Future[None] | None = None
    wait_since: float | None = None
    paused_since: float | None = None
    paused_seconds: float = 0.0
    pending_seconds: float = 0.0
    ever_admitted: bool = False


@dataclass
class GateCounters:
    pauses: int = 0
    resumes: int = 0
    admissions: int = 0
    max_holders: int = 0
    events: list[tuple[str, str]] = field(default_factory=list)  # (what, agent) since drain


class Gate:
    def __init__(
        self,
        window: int,
        unit: Literal["agent", "request"] = "agent",
        pause_rule: str = "newest",
        resume_rule: str = "oldest",
        clock: Callable[[], float] | None = None,
    ) -> None:
        if pause_rule not in PAUSE_RULES:
            raise ValueError(
                f"unknown pause rule {pause_rule!r}; choose one of {list(PAUSE_RULES)}"
            )
        if resume_rule not in RESUME_RULES:
            raise ValueError(
                f"unknown resume rule {resume_rule!r}; choose one of {list(RESUME_RULES)}"
            )
        self.unit = unit
        self.pause_rule = pause_rule
        self.resume_rule = resume_rule
        self._clock_fn = clock or (lambda: asyncio.get_running_loop().time())
        self._last_now = 0.0
        self._agents: dict[str, _Agent] = {}
        self._order = itertools.count()
        self._admit_seq = itertools.count()
        self._window = max(1, window)
        self.counters = GateCounters()
        self.peak_in_use = 0  # most holders at once since the last control period

    # ---- what the agent loop calls -------------------------------------------------------

    def register(self, key: str) -> None:
        """Announce an agent (pending) so the window bound and the admission order know it."""
        if key not in self._agents:
            self._agents[key] = _Agent(key, next(self._order), wait_since=self._clock())

    async def acquire(self, key: str, context_tokens: int = 0) -> None:
        """Return when `key` may send its next request. A step boundary."""
        self.register(key)
        a = self._agents[key]
        a.context = context_tokens
        if a.state == "active":
            return
        if a.state == "marked":  # stop here: give the slot up and wait to be resumed
            a.state = "paused"
            a.paused_since = self._clock()
            self.counters.pauses += 1
            self.counters.events.append(("paused", key))
        elif a.state == "idle":  # request unit: between requests an agent holds nothing
            a.state = "pending"
            a.wait_since = self._clock()
            a.order = next(self._order)
        elif a.state == "done":
            raise RuntimeError(f"agent {key!r} acquired the gate after finishing")
        # The future exists before _fill runs, so this agent can be granted in the same pass.
        a.waiter = asyncio.get_running_loop().create_future()
        try:
            self._fill()
            await a.waiter
        except asyncio.CancelledError:
            if a.state == "active":  # granted just as we were cancelled: pass the slot on
                a.state = "done"
                self._fill()
            raise
        finally:
            a.waiter = None

    def done_request(self, key: str) -> None:
        """The agent's request has finished. With a request unit this frees the slot."""
        a = self._agents.get(key)
        if a is not None and self.unit == "request" and a.state in ("active", "marked"):
            a.state = "idle"
            self._fill()

    def finish(self, key: str) -> None:
        """The agent ended (any status): free its slot for good."""
        a = self._agents.get(key)
        if a is None or a.state == "done":
            return
        now = self._clock()
        if a.state == "paused" and a.paused_since is not None:
            a.paused_seconds += now - a.paused_since
        if a.state == "pending" and a.wait_since is not None:
            a.pending_seconds += now - a.wait_since
        a.state = "done"
        if a.waiter is not None and not a.waiter.done():
            a.waiter.cancel()
        self._fill()

    # ---- what the controller calls -------------------------------------------------------

    @property
    def window(self) -> int:
        return self._window

    def resize(self, window: int) -> int:
        """Set W (clamped to [1, unfinished]); mark the excess paused or let waiters in.
        Returns the window actually set."""
        unfinished = sum(1 for a in self._agents.values() if a.state != "done")
        self._window = max(1, min(window, max(1, unfinished)))
        running = [a for a in self._agents.values() if a.state == "active"]
        excess = len(running) - self._window
        if excess > 0:
            for a in self._pause_order(running)[:excess]:
                a.state = "marked"
                self.counters.events.append(("marked", a.key))
        self._fill()
        return self._window

    def counts(self) -> dict[str, int]:
        c = {"active": 0, "paused": 0, "pending": 0, "finished": 0, "in_tool_or_idle": 0}
        for a in self._agents.values():
            if a.state == "active":
                c["active"] += 1
            elif a.state in ("marked", "paused"):
                c["paused"] += 1
            elif a.state == "pending":
                c["pending"] += 1
            elif a.state == "done":
                c["finished"] += 1
            else:
                c["in_tool_or_idle"] += 1
        c["unfinished"] = len(self._agents) - c["finished"]
        return c

    def holders(self) -> int:
        return sum(1 for a in self._agents.values() if a.state in ("active", "marked"))

    def drain_events(self) -> list[tuple[str, str]]:
        ev, self.counters.events = self.counters.events, []
        return ev

    def reset_peak(self) -> int:
        peak, self.peak_in_use = self.peak_in_use, self.holders()
        return peak

    def wait_totals(self) -> tuple[float, float]:
        """Seconds agents spent paused and pending, summed (open intervals counted to now)."""
        now = self._clock()
        paused = pending = 0.0
        for a in self._agents.values():
            paused += a.paused_seconds
            pending += a.pending_seconds
            if a.state == "paused" and a.paused_since is not None:
                paused += now - a.paused_since
            if a.state == "pending" and a.wait_since is not None:
                pending += now - a.wait_since
        return paused, pending

    # ---- mechanism -----------------------------------------------------------------------

    def _clock(self) -> float:
        """Loop time; after the loop has closed (final summary), the last time seen."""
        try:
            self._last_now = self._clock_fn()
        except RuntimeError:
            pass
        return self._last_now

    def _pause_order(self, running: list[_Agent]) -> list[_Agent]:
        if self.pause_rule == "shortest":
            return sorted(running, key=lambda a: (a.context, -a.admitted_seq))
        if self.pause_rule == "longest":
            return sorted(running, key=lambda a: (-a.context, -a.admitted_seq))
        return sorted(running, key=lambda a: -a.admitted_seq)

    def _resume_key(self, a: _Agent) -> tuple[float, int]:
        if self.resume_rule == "longest":
            return (-a.context, a.order)
        if self.resume_rule == "shortest":
            return (a.context, a.order)
        return (a.paused_since or 0.0, a.order)

    def _fill(self) -> None:
        agents = self._agents.values()
        unmarked = sum(1 for a in agents if a.state == "active")
        # 1. unmark: cheapest to keep going, their KV is still warm
        if unmarked < self._window:
            marked = [a for a in agents if a.state == "marked"]
            for a in sorted(marked, key=lambda a: a.admitted_seq)[: self._window - unmarked]:
                a.state = "active"
                self.counters.events.append(("unmarked", a.key))
        holders = self.holders()
        room = self._window - holders
        if room > 0:
            # 2. resume paused agents that are waiting at a boundary, then 3. admit pending
            paused = sorted(
                (a for a in agents if a.state == "paused" and a.waiter is not None),
                key=self._resume_key,
            )
            pending = sorted(
                (a for a in agents if a.state == "pending" and a.waiter is not None),
                key=lambda a: a.order,
            )
            for a in (paused + pending)[:room]:
                self._grant(a)
        self.peak_in_use = max(self.peak_in_use, self.holders())
        self.counters.max_holders = max(self.counters.max_holders, self.holders())

    def _grant(self, a: _Agent) -> None:
        now = self._clock()
        if a.state == "paused":
            a.paused_seconds += now - (a.paused_since or now)
            a.paused_since = None
            self.counters.resumes += 1
            self.counters.events.append(("resumed", a.key))
        else:
            a.pending_seconds += now - (a.wait_since or now)
            if not a.ever_admitted or self.unit == "agent":
                self.counters.events.append(("admitted", a.key))
            self.counters.admissions += 1
            a.ever_admitted = True
        a.wait_since = None
        a.state = "active"
        a.admitted_seq = next(self._admit_seq)
        if a.waiter is not None and not a.waiter.done():
            a.waiter.set_result(None)
