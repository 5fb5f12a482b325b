"""The gate as it was before its agents were kept in order (main at 13e7131, runner/gate/gate.py):
`contexts()` and the pause / unmark orders computed by sorting every agent. Kept verbatim (the
protocols and the module doc left out) as the reference that test_gate_order.py holds the
incremental structure to: the same events in, the same decisions and contexts out. With the
tool signals of the `policy` branch added as that branch wrote them on this sort-based gate
(`tool_since`, `tool_seconds()` sorting the holders, `tool_durations()`), so the test holds
the keep order's holder walk to that sort too.

One deliberate change since (issue 16, when the gate dropped its heaps and gave slots in the
keep order): a waiter is granted only from the heap entry of its latest wait (`queued`).
Before, a paused agent whose wait was cancelled kept its old entry, and coming back with
another context (under the `longest` / `shortest` resume rules) it could be resumed at its
old place while `contexts()` showed it at its new one.
"""
# ruff: noqa

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

PAUSE_RULES = ("newest", "shortest", "longest", "least-waited")
RESUME_RULES = ("oldest", "newest", "longest", "shortest", "most-waited")
HOLDING = ("active", "marked")
TOOL_DURATIONS_KEPT = 1000


@dataclass(eq=False)
class _Agent:
    key: str
    order: int  # queue position among pending agents (task order, then re-queue order)
    state: str = "pending"  # pending | active | marked | paused | idle | done
    admitted_seq: int = -1  # when it last got a slot (for the "newest" pause rule)
    context: int = 0  # tokens in its context, as last reported
    waiter: asyncio.Future[None] | None = None
    wait_since: float | None = None
    paused_since: float | None = None
    tool_since: float | None = None  # its request finished, its next acquire not yet come
    paused_seconds: float = 0.0
    pending_seconds: float = 0.0
    ever_admitted: bool = False
    queued: tuple | None = None  # the heap entry of its latest wait


@dataclass
class GateCounters:
    pauses: int = 0
    resumes: int = 0
    events: list[tuple[str, str]] = field(default_factory=list)  # (what, agent) since drain


class Gate:
    def __init__(
        self,
        window: int,
        unit: str = "agent",
        pause_rule: str = "newest",
        resume_rule: str = "oldest",
        clock: Callable[[], float] | None = None,
        coming: Callable[[], int] | None = None,
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
        self._configured = (pause_rule, resume_rule)
        self._clock_fn = clock or (lambda: asyncio.get_running_loop().time())
        # agents not registered yet that may still come (a batch fed from a task source)
        self._coming = coming or (lambda: 0)
        self._last_now = 0.0
        self._agents: dict[str, _Agent] = {}
        self._n: Counter[str] = Counter()  # agents per state
        self._active: dict[str, _Agent] = {}
        self._marked: dict[str, _Agent] = {}
        self._paused_q: list[tuple[float, int, str]] = []  # waiting at a boundary
        self._pending_q: list[tuple[int, str]] = []  # waiting for a first (or next) slot
        self._order = itertools.count()
        self._admit_seq = itertools.count()
        self._window = max(1, window)
        self.counters = GateCounters()
        self._growth_steps = 0  # context growth between consecutive acquires, summed
        self._growth_tokens = 0
        self._tool_durations: deque[float] = deque(maxlen=TOOL_DURATIONS_KEPT)

    # ---- what the agent loop calls -------------------------------------------------------

    def register(self, key: str) -> None:
        """Announce an agent (pending), so the window bound and the admission order know it."""
        if key not in self._agents:
            a = _Agent(key, next(self._order), wait_since=self._clock())
            self._agents[key] = a
            self._n["pending"] += 1

    async def acquire(self, key: str, context_tokens: int = 0) -> None:
        """Return when `key` may send its next request. Each call is a step boundary."""
        self.register(key)
        a = self._agents[key]
        if a.context and context_tokens > a.context:  # one step's growth: reply + observation
            self._growth_steps += 1
            self._growth_tokens += context_tokens - a.context
        a.context = context_tokens
        if a.tool_since is not None:  # back from a tool call: how long it took
            self._tool_durations.append(self._clock() - a.tool_since)
            a.tool_since = None
        if a.state == "active":
            return  # the hot path: an admitted agent between steps
        if a.state == "done":
            raise RuntimeError(f"agent {key!r} acquired the gate after finishing")
        now = self._clock()
        if a.state == "marked":  # stop here: give the slot up and wait to be resumed
            self._move(a, "paused")
            a.paused_since = now
            self.counters.pauses += 1
            self.counters.events.append(("paused", key))
        elif a.state == "idle":  # request unit: between requests an agent holds nothing
            self._move(a, "pending")
            a.wait_since = now
            a.order = next(self._order)
        a.waiter = asyncio.get_running_loop().create_future()
        if a.state == "paused":
            a.queued = (*self._resume_key(a), key)
            heapq.heappush(self._paused_q, a.queued)
        else:
            a.queued = (a.order, key)
            heapq.heappush(self._pending_q, a.queued)
        try:
            self._fill()  # may grant this very agent
            await a.waiter
        except asyncio.CancelledError:
            if a.state in HOLDING:  # granted just as we were cancelled: pass the slot on
                self._move(a, "done")
                self._fill()
            raise
        finally:
            a.waiter = None

    def done_request(self, key: str) -> None:
        """The agent's request has finished. With a request unit this frees the slot."""
        a = self._agents.get(key)
        if a is not None:
            a.tool_since = self._clock()
        if self.unit == "request" and a is not None and a.state in HOLDING:
            self._move(a, "idle")
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
        if a.waiter is not None and not a.waiter.done():
            a.waiter.cancel()
        self._move(a, "done")
        self._fill()

    # ---- what the controller calls -------------------------------------------------------

    @property
    def window(self) -> int:
        return self._window

    def resize(self, window: int, bound: int | None = None) -> int:
        """Set W, clamped to [1, unfinished agents, with those still `coming`] (or to `bound`,
        when agents this gate has not seen yet may still come: see ranked_gate.py); mark the
        excess paused (they stop at their next boundary) or let waiters in. Returns the window
        actually set."""
        if bound is None:
            bound = len(self._agents) - self._n["done"] + self._coming()
        self._window = max(1, min(window, max(1, bound)))
        excess = len(self._active) - self._window
        if excess > 0:
            for a in self._pause_order(list(self._active.values()))[:excess]:
                self._move(a, "marked")
                self.counters.events.append(("marked", a.key))
        self._fill()
        return self._window

    def counts(self) -> dict[str, int]:
        n = self._n
        return {
            "active": n["active"],
            "paused": n["marked"] + n["paused"],
            "pending": n["pending"],
            "finished": n["done"],
            "idle": n["idle"],
            "unfinished": len(self._agents) - n["done"],
        }

    def state(self, key: str) -> str:
        a = self._agents.get(key)
        if a is None:
            return "pending"
        return {"marked": "active"}.get(a.state, a.state)  # marked: active until its boundary

    def contexts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Context tokens of the agents that hold a slot, in the order they keep it (oldest
        admitted first; marked ones last), and of the agents waiting at the gate, in the order
        they would get one (paused agents by the resume rule, then pending in task order).
        A policy can fit a window to memory with them. O(n log n): once per period."""
        held = sorted(self._active.values(), key=lambda a: a.admitted_seq)
        held += sorted(self._marked.values(), key=lambda a: a.admitted_seq)
        waiting = sorted(
            (a for a in self._agents.values() if a.state == "paused" and a.waiter is not None),
            key=self._resume_key,
        )
        waiting += sorted(
            (a for a in self._agents.values() if a.state == "pending" and a.waiter is not None),
            key=lambda a: a.order,
        )
        return tuple(a.context for a in held), tuple(a.context for a in waiting)

    def tool_seconds(self) -> tuple[float, ...]:
        now = self._clock()
        held = sorted(self._active.values(), key=lambda a: a.admitted_seq)
        held += sorted(self._marked.values(), key=lambda a: a.admitted_seq)
        return tuple(0.0 if a.tool_since is None else now - a.tool_since for a in held)

    def tool_durations(self) -> tuple[float, ...]:
        return tuple(self._tool_durations)

    def holders(self) -> int:
        return self._n["active"] + self._n["marked"]

    def waiting(self) -> int:
        """Agents with a claim on a slot of this gate that do not hold one (pending, paused)."""
        return self._n["pending"] + self._n["paused"]

    def drain_events(self) -> list[tuple[str, str]]:
        ev, self.counters.events = self.counters.events, []
        return ev

    def growth_per_step(self) -> float | None:
        """Mean context growth between an agent's consecutive steps (reply + observation)."""
        return self._growth_tokens / self._growth_steps if self._growth_steps else None

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
        with contextlib.suppress(RuntimeError):
            self._last_now = self._clock_fn()
        return self._last_now

    def _move(self, a: _Agent, state: str) -> None:
        self._n[a.state] -= 1
        self._n[state] += 1
        self._active.pop(a.key, None)
        self._marked.pop(a.key, None)
        if state == "active":
            self._active[a.key] = a
        elif state == "marked":
            self._marked[a.key] = a
        a.state = state

    def _pause_order(self, running: list[_Agent]) -> list[_Agent]:
        if self.pause_rule == "shortest":
            return sorted(running, key=lambda a: (a.context, -a.admitted_seq))
        if self.pause_rule == "longest":
            return sorted(running, key=lambda a: (-a.context, -a.admitted_seq))
        if self.pause_rule == "least-waited":
            waited = lambda a: a.paused_seconds + a.pending_seconds  # noqa: E731
            return sorted(running, key=lambda a: (waited(a), -a.admitted_seq))
        return sorted(running, key=lambda a: -a.admitted_seq)

    def _resume_key(self, a: _Agent) -> tuple[float, int]:
        if self.resume_rule == "longest":
            return (-a.context, a.order)
        if self.resume_rule == "shortest":
            return (a.context, a.order)
        if self.resume_rule == "newest":
            return (-(a.paused_since or 0.0), a.order)
        if self.resume_rule == "most-waited":
            # the most seconds waited at any instant t (earlier waits + t - paused_since) first
            return ((a.paused_since or 0.0) - a.paused_seconds - a.pending_seconds, a.order)
        return (a.paused_since or 0.0, a.order)

    def use_rules(self, rules: tuple[str, str] | None) -> None:
        """The rules from now on (None: the configured ones); the paused queue re-sorted."""
        self.pause_rule, self.resume_rule = rules or self._configured
        self._paused_q = []
        for a in self._agents.values():
            if a.state == "paused" and a.waiter is not None and not a.waiter.done():
                a.queued = (*self._resume_key(a), a.key)
                self._paused_q.append(a.queued)
        heapq.heapify(self._paused_q)

    def _pop_waiter(self, queue: list, state: str) -> _Agent | None:
        """The first agent of a queue that still waits in `state` (stale entries dropped)."""
        while queue:
            a = self._agents[queue[0][-1]]
            live = a.waiter is not None and not a.waiter.done()
            if a.state == state and live and queue[0] == a.queued:
                heapq.heappop(queue)
                return a
            heapq.heappop(queue)
        return None

    def _fill(self) -> None:
        # 1. unmark first: cheapest to keep going, their KV is still warm
        room = self._window - self._n["active"]
        if room > 0 and self._marked:
            for m in sorted(self._marked.values(), key=lambda m: m.admitted_seq)[:room]:
                self._move(m, "active")
                self.counters.events.append(("unmarked", m.key))
        # 2. resume paused agents waiting at a boundary, then 3. admit pending ones
        while self.holders() < self._window:
            a = self._pop_waiter(self._paused_q, "paused") or self._pop_waiter(
                self._pending_q, "pending"
            )
            if a is None:
                break
            self._grant(a)

    def _grant(self, a: _Agent) -> None:
        now = self._clock()
        if a.state == "paused":
            a.paused_seconds += _since(now, a.paused_since)
            a.paused_since = None
            self.counters.resumes += 1
            self.counters.events.append(("resumed", a.key))
        else:
            a.pending_seconds += _since(now, a.wait_since)
            if not a.ever_admitted:
                self.counters.events.append(("admitted", a.key))
            a.ever_admitted = True
        a.wait_since = None
        self._move(a, "active")
        a.admitted_seq = next(self._admit_seq)
        if a.waiter is not None and not a.waiter.done():
            a.waiter.set_result(None)


def _since(now: float, t: float | None) -> float:
    """Seconds from `t` to `now` (0 if unset). Not `now - (t or now)`: a wait that began at
    t = 0.0 (a virtual clock's start) counted 0 s."""
    return 0.0 if t is None else now - t
