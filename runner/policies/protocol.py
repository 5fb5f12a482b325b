"""The policy protocol: what a policy reads (`Signals`) and what it answers (`Decision`).

Policies are small pure objects, signals in, window out. Like a TCP congestion-control
module, a policy never reads a clock, does no I/O and never touches the gate: the gate
decides WHEN (every control period, with a frozen `Signals`), the policy decides HOW MUCH
(a `Decision`). Adding a policy means writing one class (a module of this package, or of
`experimental/` while it is under trial) and registering it in registry.py; the gate and the
agent loop do not change.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

Unit = Literal["agent", "request"]
# The gate's pause and resume rules by name (runner/gate/gate.py PAUSE_RULES, RESUME_RULES: a test
# holds the two lists equal)
PauseRule = Literal["newest", "shortest", "longest", "least-waited"]
ResumeRule = Literal["oldest", "newest", "longest", "shortest", "most-waited"]


class Contexts(Protocol):
    """Every agent's context (tokens) in the gate's order: the slot holders first, in the
    order they keep their slots, then the waiting agents, in the order they would get one.
    The gate hands a live view of running totals it keeps (runner/gate/gate_order.py): `fit` and
    `total` sort nothing and read per-block sums (microseconds at 10,000 agents); iterating
    is O(n). `ContextList` is the plain version over two tuples."""

    @property
    def held(self) -> int:
        """How many of the first agents hold a slot (the rest wait)."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...

    def total(self, k: int) -> int:
        """The sum of the first k contexts."""
        ...

    def fit(self, budget: float, extra: float = 0.0, shared: int = 0) -> int:
        """How many of the first agents, in order, fit `budget` when each counts
        max(0, context - shared) + extra tokens (`extra` >= 0); 0 if `budget` < 0."""
        ...

    def fitter(self, extra: float = 0.0, shared: int = 0) -> Callable[[float], int]:
        """`fit` with this `extra` and `shared`, for many budgets (prepared once)."""
        ...


@dataclass(frozen=True)
class ContextList:
    """`Contexts` from two tuples (tests, and the reference the gate's structure is tested
    against)."""

    held_contexts: tuple[int, ...] = ()
    waiting_contexts: tuple[int, ...] = ()

    @property
    def held(self) -> int:
        return len(self.held_contexts)

    def __len__(self) -> int:
        return len(self.held_contexts) + len(self.waiting_contexts)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.held_contexts, self.waiting_contexts)

    def total(self, k: int) -> int:
        return sum(itertools.islice(self, max(0, k)))

    def fit(self, budget: float, extra: float = 0.0, shared: int = 0) -> int:
        return self.fitter(extra, shared)(budget)

    def fitter(self, extra: float = 0.0, shared: int = 0) -> Callable[[float], int]:
        """Each term is max(context, shared) - shared + extra: the running sums of
        max(context, shared) (itertools.accumulate) and the count found by bisection (every
        term is >= 0, so the sums are monotone). Where no context is below `shared` this is
        the same float expression, prefix by prefix, as before the gate kept running totals
        (sum of contexts + k x (extra - shared)); the gate's view computes it the same way."""
        if extra < 0:
            raise ValueError(f"extra must be >= 0 (each agent's term >= 0), got {extra!r}")
        sums = list(itertools.accumulate(max(c, shared) for c in self))
        per = extra - shared

        def fit(budget: float) -> int:
            if not sums or budget < 0:
                return 0
            # the number of prefixes (of 1, 2, ... agents) whose total is within the budget
            return bisect.bisect_right(
                range(len(sums)), budget, key=lambda i: sums[i] + (i + 1) * per
            )

        return fit


class Tools(Protocol):
    """The slot holders' tool calls, and the latest finished calls. The gate hands a view of
    what it keeps for this (runner/gate/gate_order.py: the holders in a call by when it began,
    the finished durations sorted), so reading it costs what it returns, not a walk of the
    holders. `ToolList` is the plain version over two tuples."""

    def durations(self) -> Sequence[float]:
        """The latest finished calls' seconds (at most 1,000), ascending."""
        ...

    def held_past(self, seconds: float) -> list[tuple[int, int]]:
        """(position among the holders in `Contexts`' held order, context) of each holder
        that has spent more than 0 and at least `seconds` seconds since its last request
        finished (in a tool call, or preparing its next turn), by position."""
        ...

    def count_past(self, seconds: float) -> int:
        """How many holders `held_past(seconds)` lists, without listing them."""
        ...

    def fit_dropping(
        self, contexts: Contexts, seconds: float, budget: float, extra: float = 0.0, shared: int = 0
    ) -> int | None:
        """`_fit_dropping(contexts, budget, extra, shared, held_past(seconds))` where the view
        can answer it from running totals (the gate's: per-block sums of the holders in a
        call, without placing each dropped holder); None where it cannot (the caller then
        computes it holder by holder)."""
        ...


@dataclass(frozen=True)
class ToolList:
    """`Tools` from tuples (tests, and the reference the gate's view is tested against):
    each holder's seconds since its request finished (0: its request is in the engine) and
    its context, in held order, and the finished calls' durations, in any order."""

    held_seconds: tuple[float, ...] = ()
    finished: tuple[float, ...] = ()
    held_contexts: tuple[int, ...] = ()

    def durations(self) -> Sequence[float]:
        return tuple(sorted(self.finished))

    def held_past(self, seconds: float) -> list[tuple[int, int]]:
        return [
            (i, c)
            # a holder without seconds is in no call
            for i, (t, c) in enumerate(zip(self.held_seconds, self.held_contexts, strict=False))
            if t > 0 and t >= seconds
        ]

    def count_past(self, seconds: float) -> int:
        return len(self.held_past(seconds))

    def fit_dropping(
        self, contexts: Contexts, seconds: float, budget: float, extra: float = 0.0, shared: int = 0
    ) -> int | None:
        return None  # no running totals: `_fit_dropping` over `held_past`


@dataclass(frozen=True)
class Signals:
    """What the gate knows at the end of one control period."""

    now: float
    window: int  # the current window W_t
    usage: float | None  # U_t: KV pool occupancy fraction; None if the engine cannot tell
    hit_rate: float | None  # H_t over requests finished this period; None if none finished
    active: int  # slot holders not marked paused
    paused: int  # paused agents (marked, or waiting to resume)
    pending: int  # agents never admitted yet
    finished: int
    unfinished: int  # everyone not finished: the upper bound of W
    # Richer signals; None / empty where the engine or the gate cannot tell.
    capacity_tokens: int | None = None  # the engine's KV pool size, tokens
    # the most agents' contexts the engine keeps at once, where fewer than its tokens allow
    # (llama.cpp's sequence slots); None: only tokens limit it
    resident_limit: int | None = None
    # every agent's context: slot holders in keep order, then waiting ones in admission order
    contexts: Contexts = ContextList()
    # the slot holders' tool calls (how long each has been out of the engine) and the
    # latest finished calls' durations
    tools: Tools = ToolList()
    # seconds the engine takes to recompute one token of an evicted context
    recompute_token_seconds: float | None = None
    growth_per_step: float | None = None  # mean context growth per agent step, tokens
    recompute_rate: float | None = None  # prompt tokens neither cached nor new, this period
    # prefix all agents share (e.g. the system prompt) and the engine stores once; 0 where
    # each context keeps its own copy (llama.cpp)
    shared_tokens: int | None = None
    host_capacity_tokens: int | None = None  # a host-memory KV tier (HiCache), tokens
    host_reload_cost: float | None = None  # reloading a token / recomputing it
    # seconds of the host-to-device link per token reloaded from the host tier
    host_reload_token_seconds: float | None = None
    period_seconds: float | None = None  # the control period: seconds until the next update
    # requests the engine finished per second (agents' steps), over the last few periods
    requests_per_second: float | None = None


@dataclass(frozen=True)
class Order:
    """Whom the gate pauses first when the window shrinks, and whom it resumes first when it
    grows: a pair of the gate's rules, which a policy may choose period by period."""

    pause: PauseRule
    resume: ResumeRule

    def __str__(self) -> str:
        return f"{self.pause}/{self.resume}"


@dataclass(frozen=True)
class Coalesce:
    """Hold each slot holder that comes back from a tool call for up to `seconds` before its
    next request, and send the held ones together once they bring `tokens` new tokens (or
    the first of them has waited `seconds`): the engine then prefills them in one iteration
    instead of one each (each iteration pays its launch and weight reads again)."""

    seconds: float
    tokens: int


@dataclass(frozen=True)
class Decision:
    window: int
    branch: str  # why: "increase" | "decrease" | "hold" | "fixed" ...
    order: Order | None = None  # the pause/resume order from now on; None: the gate's own
    coalesce: Coalesce | None = None  # hold requests back to batch them; None: send at once


class Policy(Protocol):
    """A frozen dataclass whose fields are its parameters (`--policy name:key=value`)."""

    name: ClassVar[str]
    unit: ClassVar[Unit]  # what a slot is held for: a whole agent life, or one request
    # the gate's pause and resume rules the policy runs with unless --pause-rule or
    # --resume-rule say otherwise (the rules it was measured with)
    rules: ClassVar[tuple[PauseRule, ResumeRule]]
    # whether Signals must carry the agents' contexts (the gate's view: cheap, but only the
    # policies that read it get it)
    wants_contexts: ClassVar[bool]
    # whether Signals must carry the holders' tool calls and the latest tool durations
    wants_tools: ClassVar[bool]

    def initial_window(self, n_agents: int) -> int: ...

    def update(self, s: Signals) -> Decision: ...

    def params(self) -> dict[str, Any]: ...
