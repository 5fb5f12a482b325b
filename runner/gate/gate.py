"""The agent-level admission gate: mechanism only (the policy decides the window).

Every agent calls `acquire(agent)` before each generation, `done_request(agent)` after it,
and `finish(agent)` when it ends. A slot is held for a whole agent life (policy unit "agent")
or for one request (unit "request").

States of an agent:

    pending --admit--> active --resize below W--> marked --next acquire--> paused
                        |  ^                        |                        |
                        |  +--------unmark----------+                        |
                        |  +--------------------resume-----------------------+
                      finish -> done                (request unit: active -> idle -> pending)

- `active` and `marked` agents hold a slot. A marked agent still finishes the request it has
  in the engine (requests are never cancelled) and stops at its next step boundary, i.e. its
  next `acquire`, where it gives its slot up and waits as `paused`, state and tools kept.
- Invariant: (slot holders not marked) <= W at every instant; new slots are granted only
  while all holders, marked ones included, are below W (a marked agent's KV is still in use).
- Growing W unmarks marked agents first (their cache is warm), then resumes paused agents,
  then admits pending ones, in the orders the chosen rules give (documented in PAUSE_RULES
  and RESUME_RULES; pending agents are admitted in task order).
- Waiting is one future per agent; a slot granted to a waiter that got cancelled is passed on.
- The hot path (acquire while admitted) is O(1); done_request, finish and admitting a waiter
  are O(log n): counts kept incrementally, and every holder and waiter kept in the order the
  policies read (runner/gate/gate_order.py: the contexts' running totals, updated as they change),
  which is also the order waiters get slots in (the first of the paused, then of the
  pending). So a control period sorts nothing: `contexts()` is a view, resizing touches
  only the agents it pauses, unmarks or lets in (the newest holders marked and the oldest
  marked unmarked move as runs of whole blocks; the pause rules by context select from the
  active agents: O(n), those two rules only). `bench/gate_bench.py` measures it with
  10,000 agents.

Two interfaces: `AdmissionGate` is what the agent loop and the batch use (a `Gate`, or the
per-rank `RankedGate`); `ControlledGate` is what a controller steers (a `Gate`, or one rank's
`RankView`). Both are implemented explicitly.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .gate_order import UNPLACED, Block, ContextsView, KeepOrder, Segment
from .tool_calls import ToolCalls, ToolsView

PAUSE_RULES: dict[str, str] = {
    "newest": "pause the most recently admitted agents first (LIFO; every policy's)",
    "shortest": "pause the agents with the shortest context first (cheapest to recompute)",
    "longest": "pause the agents with the longest context first (frees the most KV)",
    "least-waited": "pause the agents that have waited least so far first (paused and pending "
    "seconds; spreads the waiting, so no agent's finish slips far behind the others')",
}
RESUME_RULES: dict[str, str] = {
    "oldest": "resume the agent paused longest ago first (FIFO; the paper's)",
    "newest": "resume the agent paused most recently first (its KV is likeliest still cached)",
    "longest": "resume the agent with the longest context first",
    "shortest": "resume the agent with the shortest context first",
    "most-waited": "resume the agent that has waited longest in all first (its paused and "
    "pending seconds summed)",
}
HOLDING = ("active", "marked")
_items = operator.attrgetter("items")
_paused_seconds = operator.attrgetter("paused_seconds")
_pending_seconds = operator.attrgetter("pending_seconds")
_admitted_seq = operator.attrgetter("admitted_seq")
_active_stamp = operator.attrgetter("active_stamp")
# a run of at least this many holders marked or unmarked at once moves as whole blocks; a
# shorter one moves agent by agent (cheaper than cutting and joining blocks)
RUN = 16
TOOL_DURATIONS_KEPT = 1000  # the latest tool calls a policy sees (Signals.tool_durations)
Unit = Literal["agent", "request"]


class AdmissionGate(Protocol):
    """The gate as the agent loop and the batch see it."""

    unit: Unit

    def register(self, key: str) -> None: ...

    async def acquire(self, key: str, context_tokens: int = 0) -> None: ...

    def done_request(self, key: str) -> None: ...

    def finish(self, key: str) -> None: ...

    @property
    def window(self) -> int: ...

    def counts(self) -> dict[str, int]: ...

    def state(self, key: str) -> str:
        """One agent's state for a display: pending, active, paused, idle or done."""
        ...


class ControlledGate(Protocol):
    """One window as its controller sees it: public state in, a new size out."""

    pause_rule: str
    resume_rule: str

    @property
    def counters(self) -> GateCounters: ...

    @property
    def window(self) -> int: ...

    def resize(self, window: int) -> int: ...

    def use_rules(self, rules: tuple[str, str] | None) -> None: ...

    def coalesce(self, seconds: float, tokens: int) -> None: ...

    def counts(self) -> dict[str, int]: ...

    def contexts(self) -> ContextsView: ...

    def tools(self) -> ToolsView: ...

    def growth_per_step(self) -> float | None: ...

    def drain_events(self) -> list[tuple[str, str]]: ...

    def wait_totals(self) -> tuple[float, float]: ...


@dataclass(eq=False, slots=True)
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
    block: Block = UNPLACED  # its place in the keep order (gate_order.py), if it has one
    sort_key: Any = None
    in_call: bool = False  # among the open tool calls (gate_order.ToolCalls)
    active_stamp: int = 0  # counts its entries into `active` (Gate._by_wait's entries)


@dataclass
class GateCounters:
    pauses: int = 0
    resumes: int = 0
    holds: int = 0  # requests held back to be sent together (Gate.coalesce)
    hold_seconds: float = 0.0  # the time they were held, summed
    events: list[tuple[str, str]] = field(default_factory=list)  # (what, agent) since drain


class Gate:
    def __init__(
        self,
        window: int,
        unit: Unit = "agent",
        pause_rule: str = "newest",
        resume_rule: str = "oldest",
        clock: Callable[[], float] | None = None,
        coming: Callable[[], int] | None = None,
        track_tools: bool = True,
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
        self.pause_rule = pause_rule  # the configured rules (a policy may choose others a
        self.resume_rule = resume_rule  # while: use_rules)
        self._pause_now, self._resume_now = pause_rule, resume_rule  # the rules in effect
        # While the pause rule is least-waited: the active agents by (waited, -admitted_seq),
        # a heap with stale entries skipped when popped (an active agent's wait cannot change
        # until it leaves `active`), so a pause does not scan every active agent.
        self._by_wait: list[tuple[float, int, int, _Agent]] | None = None
        self._clock_fn = clock or (lambda: asyncio.get_running_loop().time())
        # agents not registered yet that may still come (a batch fed from a task source)
        self._coming = coming or (lambda: 0)
        self._last_now = 0.0
        self._agents: dict[str, _Agent] = {}
        self._n: Counter[str] = Counter()  # agents per state
        self._keep = KeepOrder()  # holders and waiters in the order the policies read
        self._order = itertools.count()
        self._admit_seq = itertools.count()
        self._window = max(1, window)
        self.counters = GateCounters()
        self._growth_steps = 0  # context growth between consecutive acquires, summed
        self._growth_tokens = 0
        # the holders in tool calls and the latest calls' durations (request finished ->
        # next acquire), timed only for policies that read them (two clock reads a step
        # otherwise wasted)
        self._track_tools = track_tools
        self._calls = ToolCalls(TOOL_DURATIONS_KEPT)
        # coalescing (`coalesce`): holders back from a tool held until the oldest has waited
        # _hold_seconds or they bring _hold_tokens new tokens, then sent together
        self._hold_seconds, self._hold_tokens = 0.0, 0
        self._held: list[tuple[asyncio.Future[None], float, int]] = []  # (waiter, since, tokens)
        self._held_tokens = 0
        self._hold_timer: asyncio.TimerHandle | None = None

    # ---- what the agent loop calls -------------------------------------------------------

    def register(self, key: str) -> None:
        """Announce an agent (pending), so the window bound and the admission order know it."""
        if key not in self._agents:
            a = _Agent(key, next(self._order), wait_since=self._clock())
            self._agents[key] = a
            self._n["pending"] += 1

    async def acquire(self, key: str, context_tokens: int = 0) -> None:
        """Return when `key` may send its next request. Each call is a step boundary."""
        try:
            a = self._agents[key]
        except KeyError:  # not announced: register it now
            self.register(key)
            a = self._agents[key]
        old = a.context
        if a.tool_since is not None:  # back from a tool call: how long it took
            self._calls.done(self._clock() - a.tool_since)
            self._calls.end(a)  # with its context of the call
            a.tool_since = None
        a.context = context_tokens
        if a.state == "active":  # the hot path: an admitted agent between steps
            a.block.total += context_tokens - old  # its block's running total, in O(1)
            if context_tokens > old:
                if old:  # one step's growth: reply + observation
                    self._growth_steps += 1
                    self._growth_tokens += context_tokens - old
            elif context_tokens < a.block.low:  # a context that shrank (rare)
                a.block.low = context_tokens
            if self._hold_seconds > 0 and old and context_tokens > old:  # back from a tool
                await self._hold(context_tokens - old)
            return
        if context_tokens > old and old:
            self._growth_steps += 1
            self._growth_tokens += context_tokens - old
        seg = a.block.segment
        if seg is not None:  # a marked agent leaves its place (with its new context)
            a.block.total += context_tokens - old
            seg.remove(a)
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
        try:
            keep, n = self._keep, self._n
            if not (n["marked"] or keep.paused.size or keep.pending.size) and (
                n["active"] < self._window
            ):  # room, and nobody to unmark or ahead of it: what _fill would do, at once
                self._grant(a, now)
            else:
                self._place_waiter(a)
                self._fill()  # may grant this very agent
            await a.waiter
        except asyncio.CancelledError:
            if a.state in HOLDING:  # granted just as we were cancelled: pass the slot on
                self._move(a, "done")
                self._fill()
            raise
        finally:
            a.waiter = None
            if a.state in ("paused", "pending"):  # cancelled while waiting: no longer waits
                self._keep.remove(a)

    def done_request(self, key: str) -> None:
        """The agent's request has finished. With a request unit this frees the slot."""
        a = self._agents.get(key)
        if a is None:
            return
        if self._track_tools:
            a.tool_since = self._clock()
        if self.unit == "request" and a.state in HOLDING:
            self._move(a, "idle")
            self._fill()
        elif self._track_tools and a.state in HOLDING:
            self._calls.begin(a)

    def finish(self, key: str) -> None:
        """The agent ended (any status): free its slot for good."""
        a = self._agents.get(key)
        if a is None or a.state == "done":
            return
        now = self._clock()
        if a.state == "paused":
            a.paused_seconds += _since(now, a.paused_since)
        if a.state == "pending":
            a.pending_seconds += _since(now, a.wait_since)
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
        excess = self._n["active"] - self._window
        if excess >= RUN and self._pause_now == "newest":
            marked = self._shift(self._keep.active.take_last(excess), "marked")
            self.counters.events += (("marked", a.key) for a in reversed(marked))
        elif excess > 0:
            for a in self._pause_order(excess):
                self._move(a, "marked")
                self.counters.events.append(("marked", a.key))
        self._fill()
        return self._window

    def coalesce(self, seconds: float, tokens: int) -> None:
        """From now on hold each slot holder that comes back from a tool (its context grown
        since its last request) until the first held has waited `seconds` or the held ones'
        growth reaches `tokens`, then let them all go at once, so that the engine prefills
        them together (runner.policies.protocol.Coalesce); seconds 0: no holding (any held go
        now)."""
        self._hold_seconds, self._hold_tokens = max(0.0, seconds), tokens
        if not self._hold_seconds:
            self._release_held()

    @property
    def rules(self) -> tuple[str, str]:
        """The pause and resume rules in effect (the configured ones, or a policy's)."""
        return self._pause_now, self._resume_now

    def use_rules(self, rules: tuple[str, str] | None) -> None:
        """Pause and resume by `rules` (names of PAUSE_RULES, RESUME_RULES) from now on, or by
        the configured ones (None): how a policy's `Decision.order` reaches the gate. A new
        resume rule re-places the paused agents in its order (O(paused x log); only when the
        rule changes)."""
        pause, resume = rules or (self.pause_rule, self.resume_rule)
        if pause not in PAUSE_RULES or resume not in RESUME_RULES:
            raise ValueError(f"unknown pause/resume rules {pause!r}/{resume!r}")
        self._pause_now = pause
        if pause != "least-waited":
            self._by_wait = None  # built again from `active` when the rule returns
        if resume == self._resume_now:
            return
        self._resume_now = resume
        paused = self._keep.paused
        waiters = list(paused)
        for a in waiters:
            paused.remove(a)
        for a in waiters:
            paused.add(a, self._resume_key(a))

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

    def contexts(self) -> ContextsView:
        """Context tokens of the agents that hold a slot, in the order they keep it (oldest
        admitted first; marked ones last), then of the agents waiting at the gate, in the
        order they would get one (paused agents by the resume rule, then pending in task
        order). A policy can fit a window to memory with them. A live view of running totals
        the gate keeps (gate_order.py): O(1) to get, no sort."""
        return ContextsView(self._keep)

    def tools(self) -> ToolsView:
        """The slot holders' tool calls (seconds since each one's request finished: in a tool
        call, or preparing its next turn) and the latest finished calls' durations (at most
        TOOL_DURATIONS_KEPT), as of now: a view of what the gate keeps in order (the holders
        by when their call began, the durations sorted), answered without a walk of the
        holders; kept only for policies that want it (`wants_tools`)."""
        return ToolsView(self._keep, self._calls, self._clock())

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
            if a.state == "paused":
                paused += _since(now, a.paused_since)
            if a.state == "pending":
                pending += _since(now, a.wait_since)
        return paused, pending

    # ---- mechanism -----------------------------------------------------------------------

    async def _hold(self, tokens: int) -> None:
        """Wait with the other held holders (`coalesce`); on the loop's clock, which the
        hold's timer keeps."""
        if self._held_tokens + tokens >= self._hold_tokens:  # it completes them: all go now
            self._release_held()
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (fut, loop.time(), tokens)
        self._held.append(entry)
        self._held_tokens += tokens
        if self._hold_timer is None:
            self._hold_timer = loop.call_later(self._hold_seconds, self._release_held)
        try:
            await fut
        except asyncio.CancelledError:  # its agent was cancelled: it no longer waits
            if entry in self._held:
                first = self._held[0] is entry
                self._held.remove(entry)
                self._held_tokens -= tokens
                if first and self._hold_timer is not None:  # the hold now runs from the next
                    self._hold_timer.cancel()
                    self._hold_timer = None
                    if self._held:
                        due = self._held[0][1] + self._hold_seconds
                        self._hold_timer = loop.call_at(due, self._release_held)
            raise

    def _release_held(self) -> None:
        held, self._held, self._held_tokens = self._held, [], 0
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if not held:
            return
        now = asyncio.get_running_loop().time()
        for fut, since, _ in held:
            if not fut.done():
                fut.set_result(None)
                self.counters.holds += 1
                self.counters.hold_seconds += now - since

    def _clock(self) -> float:
        """Loop time; after the loop has closed (final summary), the last time seen."""
        # not contextlib.suppress: this runs at every admission (and every step where tools
        # are timed), and try is cheaper
        try:
            now = self._clock_fn()
        except RuntimeError:
            return self._last_now
        self._last_now = now
        return now

    def _move(self, a: _Agent, state: str) -> None:
        """Change `a`'s state; a holder takes its place in the keep order (by admission)."""
        n = self._n
        n[a.state] -= 1
        n[state] += 1
        self._keep.remove(a)
        if a.tool_since is not None:  # a holder in a call is among the open calls
            if state not in HOLDING:
                self._calls.end(a)
            elif a.state not in HOLDING:  # a call reported while it waited (tests do)
                self._calls.begin(a)
        a.state = state
        if state == "active":
            self._keep.active.add(a, a.admitted_seq)
            self._enter_active(a)
        elif state == "marked":
            self._keep.marked.add(a, a.admitted_seq)

    def _place_waiter(self, a: _Agent) -> None:
        """A waiter (an agent inside acquire that holds no slot) takes its place in the order
        it will get one. Registered agents that never asked, idle and finished ones have
        none."""
        if a.state == "paused":
            self._keep.paused.add(a, self._resume_key(a))
        elif a.state == "pending":
            self._keep.pending.add(a, a.order)

    def _shift(self, blocks: list[Block], state: str) -> list[_Agent]:
        """Holders in `blocks` (taken from the active or the marked segment, in admission
        order) become `state` (marked or active) and join that segment, as whole blocks
        where their admissions do not interleave with its own (the common case: the newest
        marked, the oldest unmarked). Both states hold a slot: no tool call changes."""
        moved = [a for b in blocks for a in b.items]
        for a in moved:
            a.state = state
            if state == "active":
                self._enter_active(a)
        other = "active" if state == "marked" else "marked"
        self._n[other] -= len(moved)
        self._n[state] += len(moved)
        seg = self._keep.active if state == "active" else self._keep.marked
        if not seg.put(blocks):
            for a in moved:
                seg.add(a, a.admitted_seq)
        return moved

    def _pause_order(self, excess: int) -> list[_Agent]:
        """The `excess` active agents to mark, in the order the pause rule in effect gives
        (`resize` takes a run of RUN or more of the newest admitted as whole blocks instead)."""
        active, rule = self._keep.active, self._pause_now
        if rule == "shortest":
            return heapq.nsmallest(excess, active, key=lambda a: (a.context, -a.admitted_seq))
        if rule == "longest":
            return heapq.nsmallest(excess, active, key=lambda a: (-a.context, -a.admitted_seq))
        if rule == "least-waited":
            return self._least_waited(excess)
        return active.last(excess)  # newest admitted first

    def _enter_active(self, a: _Agent) -> None:
        a.active_stamp += 1
        if self._by_wait is not None:
            heapq.heappush(self._by_wait, (_waited(a), -a.admitted_seq, a.active_stamp, a))

    def _least_waited(self, excess: int) -> list[_Agent]:
        """The `excess` active agents that have waited least (the newest admitted first among
        equals), from the heap; the heap is rebuilt from `active` when first needed and when
        stale entries outnumber the live ones."""
        heap = self._by_wait
        if heap is None or len(heap) > 2 * self._n["active"] + 64:
            heap = _by_wait(self._keep.active)
            self._by_wait = heap
        out: list[_Agent] = []
        while heap and len(out) < excess:
            _, _, stamp, a = heapq.heappop(heap)
            if a.state == "active" and a.active_stamp == stamp:
                out.append(a)
        return out

    def _resume_key(self, a: _Agent) -> tuple[float, int]:
        rule = self._resume_now
        if rule == "longest":
            return (-a.context, a.order)
        if rule == "shortest":
            return (a.context, a.order)
        if rule == "newest":
            return (-(a.paused_since or 0.0), a.order)
        if rule == "most-waited":
            # waited by time t: _waited(a) + t - paused_since; the largest first at any t
            return ((a.paused_since or 0.0) - _waited(a), a.order)
        return (a.paused_since or 0.0, a.order)

    def _fill(self) -> None:
        # 1. unmark first: cheapest to keep going, their KV is still warm
        room = self._window - self._n["active"]
        if room >= RUN and self._n["marked"] >= RUN:  # oldest admitted first, as a run
            unmarked = self._shift(self._keep.marked.take_first(room), "active")
            self.counters.events += (("unmarked", a.key) for a in unmarked)
        elif room > 0 and self._n["marked"]:
            for m in self._keep.marked.first(room):
                self._move(m, "active")
                self.counters.events.append(("unmarked", m.key))
        # 2. resume paused agents waiting at a boundary, then 3. admit pending ones
        room = self._window - self._n["active"] - self._n["marked"]
        if room > 0:
            granted = self._next_waiters(room)
            if granted:
                now = self._clock()  # one reading for all the agents let in at this instant
                for a in granted:
                    self._grant(a, now)

    def _next_waiters(self, room: int) -> list[_Agent]:
        """The next (at most) `room` agents to get a slot: paused ones first, then pending
        ones. A run of them at the head of a segment is detached from it at once (their
        removals then cost nothing: see `KeepOrder.remove`)."""
        out: list[_Agent] = []
        for seg in (self._keep.paused, self._keep.pending):
            run = True  # whether those taken so far are the segment's first members
            taken = 0
            for a in seg:
                if len(out) == room:
                    break
                if a.waiter is not None and not a.waiter.done():
                    out.append(a)
                    taken += 1
                else:  # a cancelled one leaves when its task runs on
                    run = False
            if run and taken >= RUN:
                seg.take_first(taken)
            if len(out) == room:
                break
        return out

    def _grant(self, a: _Agent, now: float) -> None:
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
        a.admitted_seq = next(self._admit_seq)  # before the move: its place among holders
        self._move(a, "active")
        if a.waiter is not None and not a.waiter.done():
            a.waiter.set_result(None)


def _by_wait(active: Segment) -> list[tuple[float, int, int, _Agent]]:
    """`Gate._by_wait` built from the active agents: their entries, (waited, -admitted_seq,
    active_stamp, agent), mapped in C rather than one tuple built in Python each (the first
    period under `least-waited` at 5,000 holders: ~2.9 ms that way), then heapified."""
    agents = list(itertools.chain.from_iterable(map(_items, active.blocks)))
    waited = map(operator.add, map(_paused_seconds, agents), map(_pending_seconds, agents))
    seqs = map(operator.neg, map(_admitted_seq, agents))
    heap = list(zip(waited, seqs, map(_active_stamp, agents), agents, strict=True))
    heapq.heapify(heap)
    return heap


def _waited(a: _Agent) -> float:
    """Seconds `a` has waited at the gate so far, paused or pending (closed intervals)."""
    return a.paused_seconds + a.pending_seconds


def _since(now: float, t: float | None) -> float:
    """Seconds from `t` to `now` (0 if unset). Not `now - (t or now)`: a wait that began at
    t = 0.0 (a virtual clock's start) counted 0 s."""
    return 0.0 if t is None else now - t
