"""Admission policies: small pure objects, signals in, window out.

Like a TCP congestion-control module, a policy never reads a clock, does no I/O and never
touches the gate: the gate decides WHEN (every control period, with a frozen `Signals`), the
policy decides HOW MUCH (a `Decision`). Adding a policy means writing one class here and
registering it; the gate and the agent loop do not change.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import operator
import types
import typing
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Protocol

Unit = Literal["agent", "request"]
# The gate's pause and resume rules by name (runner/gate.py PAUSE_RULES, RESUME_RULES: a test
# holds the two lists equal)
PauseRule = Literal["newest", "shortest", "longest", "least-waited"]
ResumeRule = Literal["oldest", "newest", "longest", "shortest", "most-waited"]


class Contexts(Protocol):
    """Every agent's context (tokens) in the gate's order: the slot holders first, in the
    order they keep their slots, then the waiting agents, in the order they would get one.
    The gate hands a live view of running totals it keeps (runner/gate_order.py): `fit` and
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
    what it keeps for this (runner/gate_order.py: the holders in a call by when it began,
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
    # every agent's context: slot holders in keep order, then waiting ones in admission order
    contexts: Contexts = ContextList()
    # the slot holders' tool calls (how long each has been out of the engine) and the
    # latest finished calls' durations
    tools: Tools = ToolList()
    # seconds the engine takes to recompute one token of an evicted context
    recompute_token_seconds: float | None = None
    growth_per_step: float | None = None  # mean context growth per agent step, tokens
    recompute_rate: float | None = None  # prompt tokens neither cached nor new, this period
    shared_tokens: int | None = None  # prefix all agents share (e.g. the system prompt)
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


# Spread the waiting: pause who has waited least, resume who has waited most (wset2 `fair_below`)
FAIR = Order("least-waited", "most-waited")


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
    # whether Signals must carry the agents' contexts (the gate's view: cheap, but only the
    # policies that read it get it)
    wants_contexts: ClassVar[bool]
    # whether Signals must carry the holders' tool calls and the latest tool durations
    wants_tools: ClassVar[bool]

    def initial_window(self, n_agents: int) -> int: ...

    def update(self, s: Signals) -> Decision: ...

    def params(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class AIMD:
    """The CONCUR law (paper, section 3):

    W+alpha if U < U_low; floor(W*beta) if U > U_high and H < H_thresh; otherwise hold.
    With no finished request in the period H is unknown and the decrease branch cannot fire:
    a cut needs evidence of thrashing, not the absence of measurements.
    """

    alpha: int = 2
    beta: float = 0.5
    u_low: float = 0.2
    u_high: float = 0.5
    h_thresh: float = 0.2
    initial: int | None = None  # None: start at min(n_agents, 2 * alpha)

    name: ClassVar[str] = "aimd"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, int) and self.alpha >= 1):
            raise ValueError(f"--alpha must be an integer >= 1, got {self.alpha!r}")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"--beta must be in (0, 1), got {self.beta!r}")
        if not 0.0 <= self.u_low < self.u_high <= 1.0:
            raise ValueError(
                f"need 0 <= --u-low < --u-high <= 1, got u_low={self.u_low!r}, "
                f"u_high={self.u_high!r}"
            )
        if not 0.0 <= self.h_thresh <= 1.0:
            raise ValueError(f"--h-thresh must be in [0, 1], got {self.h_thresh!r}")
        if self.initial is not None and self.initial < 1:
            raise ValueError(f"--initial-window must be >= 1, got {self.initial!r}")

    def initial_window(self, n_agents: int) -> int:
        w = self.initial if self.initial is not None else 2 * self.alpha
        return max(1, min(w, max(1, n_agents)))

    def update(self, s: Signals) -> Decision:
        if s.usage is None:
            return Decision(s.window, "hold:no-usage-signal")
        if s.usage < self.u_low:
            return Decision(s.window + self.alpha, "increase")
        if s.usage > self.u_high and s.hit_rate is not None and s.hit_rate < self.h_thresh:
            return Decision(max(1, math.floor(s.window * self.beta)), "decrease")
        return Decision(s.window, "hold")

    def params(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NoGate:
    """No admission control: every agent active at once (the uncontrolled engine)."""

    name: ClassVar[str] = "none"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

    def initial_window(self, n_agents: int) -> int:
        return max(1, n_agents)

    def update(self, s: Signals) -> Decision:
        return Decision(max(1, s.unfinished), "fixed")

    def params(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class AgentCap:
    """A fixed number of agents hold slots (the paper's fixed-cap baseline)."""

    n: int
    name: ClassVar[str] = "agent-cap"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"{self.name}:N needs N >= 1, got {self.n}")

    def initial_window(self, n_agents: int) -> int:
        return self.n

    def update(self, s: Signals) -> Decision:
        return Decision(self.n, "fixed")

    def params(self) -> dict[str, Any]:
        return {"n": self.n}


@dataclass(frozen=True)
class RequestCap(AgentCap):
    """At most N generation requests in flight; an agent in a tool call holds nothing
    (the paper's request-level baseline)."""

    name: ClassVar[str] = "request-cap"
    unit: ClassVar[Unit] = "request"


@dataclass(frozen=True)
class WorkingSet:
    """Working-set admission (Denning's load control, applied to KV cache).

    Admit agents, in the order the gate would keep or admit them, while the sum of their
    projected contexts (context + `headroom_steps` x the measured growth per step) fits
    `target` x the engine's KV capacity. Agents in tool calls count in full: their prefixes
    are exactly what LRU would evict. The window thus opens wide at once in warmup (short
    contexts) and closes as contexts grow, ahead of thrashing rather than after it.

    Feedback as a correction: when the recompute rate measured this period (prompt tokens
    the engine had seen but no longer cached) exceeds `max_recompute`, the capacity estimate
    is too optimistic: the window is cut by `beta` below the fit.

    With a host KV tier (HiCache) whose reloads are cheaper than recomputes, the host tier
    beyond the device's own copies counts as capacity too (`use_host`): paused or evicted
    agents come back for a PCIe copy, so the working set may exceed the device.

    Without a capacity signal (an engine that cannot tell), it behaves as AIMD and says so
    in its branch ("aimd-fallback:...").
    """

    target: float = 0.9
    headroom_steps: float = 1.0
    max_recompute: float = 0.3
    beta: float = 0.5
    use_host: bool = True  # count a host KV tier the engine reports (see _capacity)
    fallback: AIMD = AIMD()

    name: ClassVar[str] = "wset"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = True
    wants_tools: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 2.0:  # above 1: deliberate overcommit
            raise ValueError(f"wset target must be in (0, 2], got {self.target!r}")
        _check_fit_params("wset", self.headroom_steps, self.max_recompute, self.beta)

    def initial_window(self, n_agents: int) -> int:
        return max(1, n_agents)  # nothing is resident yet: the first update fits it

    def update(self, s: Signals) -> Decision:
        if not s.capacity_tokens:
            return _aimd_fallback(self.fallback, s)
        growth = (s.growth_per_step or 0.0) * self.headroom_steps
        shared = s.shared_tokens or 0
        budget = self.target * _capacity(s, self.use_host) - shared  # shared prefix stored once
        return _cut_or_fit(s, s.contexts.fit(budget, growth, shared), self.max_recompute, self.beta)

    def params(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("fallback")
        return d


@dataclass(frozen=True)
class WorkingSet2:
    """`wset` with a reserve instead of a share, that drops the KV of agents in long tools.

    - The working set may fill the pool less a `reserve` share (the engine's own reservation
      for the running requests' decode, and dead KV that LRU keeps over a live agent's), and
      never more: a working set beyond the device pool thrashes, so no setting of this
      policy overcommits it (a host tier whose reloads are cheaper than recomputes adds its
      capacity beyond the device's copies, as in `wset`; with it the reserve is waived while
      every context fits both tiers, `_reserved_budget`, and resumes are spread over the
      host link, `_resume_cap`).
    - A slot holder in a tool call whose expected remaining time is long counts nothing: the
      window admits others in its place, and the engine's LRU evicts the longest-idle
      prefixes first, which are exactly these; the agent recomputes its context when the tool
      returns: the InferCept trade, one prefill instead of a minute of idle KV. Expected
      remaining time: the mean excess over the time already spent, among the latest finished
      tool calls. Dropping a token saves that many token-seconds of pool and costs one
      token's recompute seconds; the pool serves `capacity` token-seconds a second, so the
      trade pays when the remaining time exceeds capacity x that cost (the break-even),
      times `drop_factor`. With a host tier counted in the capacity, what the tiers cannot
      hold is recomputed too, so the cost stays a recompute's.
    - Where rebuilding KV is cheap against the tool calls, waiting is spread: while the
      engine recomputes the whole pool (capacity x recompute_token_seconds, the break-even
      above) in under `fair_below` typical tool calls (the median of the latest finished
      ones: the rare long calls are the drop's business, and they made a mean swing), the
      decision asks the gate for the `FAIR` order (pause the agent that has waited least,
      resume the one that has waited most) instead of its own. The gate's LIFO order keeps
      paused agents' KV warm but leaves the first paused waiting for most of the run, and on
      a pool of a dozen agents their chains then make the tail; where recomputes are dear
      (measured: every Qwen row) LIFO wins.
    - Where agents come back from their tools often (at least `hold_min` requests expected
      within `hold_seconds`, at the rate of the last few periods), it asks the gate to coalesce
      (`Coalesce`): an agent back from a tool waits up to `hold_seconds`, or until the held
      ones bring `hold_tokens` new tokens (a prefill chunk), and they reach the engine
      together. The engine prefills every arrival in an iteration of its own, which costs
      its launch, an all-reduce latency and a weight read (~9 ms on Qwen TP8) however few
      tokens it has; held a moment, a dozen share one. Where arrivals are sparse a hold would
      only delay the one agent (and on a chain-bound run, the batch).
    """

    reserve: float = 0.1
    headroom_steps: float = 1.0
    max_recompute: float = 0.3
    beta: float = 0.5
    use_host: bool = True
    drop_factor: float = 1.0  # x the break-even remaining tool time above which KV is dropped
    # share of a period's host link time the agents resumed in it may take to reload
    reload_share: float = 0.5
    # spread the waiting while the pool's recompute takes under this many median tool calls
    # (0: never)
    fair_below: float = 3.0
    # coalesce requests back from tools for up to this long (0: never) ...
    hold_seconds: float = 0.2
    # ... or until the held ones bring this many new tokens (SGLang's prefill chunk)
    hold_tokens: int = 8192
    # ... where at least this many requests are expected within hold_seconds
    hold_min: float = 2.0
    fallback: AIMD = AIMD()

    name: ClassVar[str] = "wset2"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = True
    wants_tools: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"wset2 reserve must be in [0, 1), got {self.reserve!r}")
        _check_fit_params("wset2", self.headroom_steps, self.max_recompute, self.beta)
        if self.drop_factor <= 0:
            raise ValueError(f"wset2 drop_factor must be > 0, got {self.drop_factor!r}")
        if not 0.0 < self.reload_share <= 1.0:
            raise ValueError(f"wset2 reload_share must be in (0, 1], got {self.reload_share!r}")
        if self.fair_below < 0:
            raise ValueError(f"wset2 fair_below must be >= 0, got {self.fair_below!r}")
        if self.hold_seconds < 0:
            raise ValueError(f"wset2 hold_seconds must be >= 0, got {self.hold_seconds!r}")
        if self.hold_tokens < 1:
            raise ValueError(f"wset2 hold_tokens must be >= 1, got {self.hold_tokens!r}")
        if self.hold_min < 0:
            raise ValueError(f"wset2 hold_min must be >= 0, got {self.hold_min!r}")
        _numpy()  # now, rather than in the first control period that drops (a 60 ms stall)

    def initial_window(self, n_agents: int) -> int:
        return max(1, n_agents)  # nothing is resident yet: the first update fits it

    def update(self, s: Signals) -> Decision:
        d = self._window(s)
        coalesce = self._coalesce(s)
        # built directly: dataclasses.replace reads the fields anew in every period
        return d if coalesce is None else Decision(d.window, d.branch, d.order, coalesce)

    def _window(self, s: Signals) -> Decision:
        if not s.capacity_tokens:
            return _aimd_fallback(self.fallback, s)
        growth = (s.growth_per_step or 0.0) * self.headroom_steps
        shared = s.shared_tokens or 0
        capacity = _capacity(s, self.use_host)
        host_counted = capacity > s.capacity_tokens  # a host tier adds to the device pool
        # the shared prefix is stored once
        budget = _reserved_budget(s, capacity, self.reserve, host_counted) - shared
        contexts = s.contexts
        per = s.recompute_token_seconds  # None: the engine cannot tell, nothing is dropped
        calls = _tool_calls(s) if per else None
        after = self._drop_after(calls, capacity, per)
        if after is not None:  # holders in calls past it count nothing
            fit = s.tools.fit_dropping(contexts, after, budget, growth, shared)
            if fit is None:
                fit = _fit_dropping(contexts, budget, growth, shared, _held_past(s, after))
        else:
            fit = contexts.fit(budget, growth, shared)
        d = _cut_or_fit(s, fit, self.max_recompute, self.beta)
        cap = _resume_cap(s, host_counted, self.reload_share)
        if cap is not None and cap < d.window:
            d = Decision(cap, "fit:reload-cap")
        return Decision(d.window, d.branch, FAIR) if self._spread(calls, capacity, per) else d

    def _drop_after(
        self, calls: _RemainingTime | None, capacity: float, per: float | None
    ) -> float | None:
        """Seconds in a tool call from which a holder's KV is dropped (None: never): the
        first time the call's expected remainder passes the break-even (`per` is a token's
        recompute seconds). With a host tier counted in `capacity`, a context the tiers
        cannot hold is recomputed, not reloaded, so the cost is a recompute's either way."""
        if calls is None or not per:
            return None
        return calls.first_above(self.drop_factor * capacity * per)

    def _coalesce(self, s: Signals) -> Coalesce | None:
        """Coalescing, where the recent request rate expects `hold_min` within a hold."""
        rate = s.requests_per_second
        if not self.hold_seconds or rate is None or rate * self.hold_seconds < self.hold_min:
            return None
        return Coalesce(self.hold_seconds, self.hold_tokens)

    def _spread(self, calls: _RemainingTime | None, capacity: float, per: float | None) -> bool:
        """Whether to ask for the `FAIR` order: recomputing the whole pool takes under
        `fair_below` median tool calls."""
        if calls is None or not per or not self.fair_below:
            return False
        return capacity * per < self.fair_below * calls.median()

    def params(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("fallback")
        return d


def _tool_calls(s: Signals) -> _RemainingTime | None:
    """The latest finished tool calls' remaining-time estimate (None: none finished yet)."""
    durations = s.tools.durations()
    return _RemainingTime(durations) if len(durations) else None


class _RemainingTime:
    """The mean excess of a tool call that has run `spent` seconds: the mean remaining time
    of the finished calls that took longer (beyond them all: `spent` again, as for a heavy
    tail). `first_above(x)` is the least time in a call at which it exceeds x: a call whose
    expected remainder once passed the break-even has had its KV dropped, so it stays
    dropped even as its expected remainder falls (between finished durations the mean
    excess only falls, so that time is 0 or one of them). Over the durations, ascending;
    `first_above` evaluates every candidate at once in numpy (the float operations of the
    scalar expression, element by element: the same values)."""

    def __init__(self, ascending: Sequence[float]) -> None:
        np = _numpy()
        # the durations both as a plain array (its scalars, and bisect, cost less than
        # numpy's) and as numpy's view of it (for the passes over all of them); the gate's
        # view hands a copy, read in place
        self._a = a = ascending if isinstance(ascending, array) else array("d", ascending)
        self._d = np.frombuffer(a, dtype=np.float64)
        # longest[k]: the k + 1 longest durations summed, from the largest down (one running
        # sum): the durations from m - 1 - k on
        self._longest = self._d[::-1].cumsum()  # the method: no wrapper call

    def median(self) -> float:
        """The middle duration (of an even count, the upper of the two)."""
        return self._a[len(self._a) // 2]

    def expected(self, spent: float) -> float:
        n = len(self._a) - bisect.bisect_right(self._a, spent)
        return spent if n == 0 else float(_mean_excess(self._longest[n - 1], n, spent))

    def first_above(self, x: float) -> float:
        a, d, m = self._a, self._d, len(self._a)
        # every call, as one just begun (a Python float: the same IEEE operations as numpy's)
        if m and _mean_excess(float(self._longest[-1]), m, 0.0) > x:
            return 0.0
        if m > 1:
            # just past d[j] (the last of equal durations): the m - 1 - j calls longer than
            # it, their durations summed (longest[m - 2 - j], j = 0 .. m - 2)
            above = _mean_excess(self._longest[-2::-1], _longer(m), d[:-1]) > x
            first = int(above.argmax())  # the first True (0 if none)
            if above[first] and a[first + 1] == a[first]:  # not the last of its ties:
                above &= d[1:] != d[:-1]  # the first among the last of equal durations, then
                first = int(above.argmax())
            if above[first]:
                return a[first]
        # beyond every finished call the expected remainder is the time spent
        if m and a[-1] > x:
            return a[-1]
        return math.nextafter(x, math.inf)


@functools.lru_cache(maxsize=4)
def _longer(m: int) -> Any:
    """m - 1, m - 2, ..., 1 as a read-only numpy array: the count of calls longer than each
    but the last of m durations, the same every period once m durations are kept. As
    floats (exact): numpy casts integers to them in every operation with the durations."""
    np = _numpy()
    out = np.arange(m - 1, 0, -1, dtype=np.float64)
    out.flags.writeable = False
    return out


def _numpy() -> types.ModuleType:
    """numpy, imported on first use: only wset2 needs it (`_RemainingTime`), and importing it
    with this module would add ~60 ms to every start of run.py."""
    import numpy

    return numpy


def _mean_excess(longer_total: Any, longer: Any, spent: Any) -> Any:
    """The mean remaining time of `longer` calls taking `longer_total` seconds in all, at
    `spent` seconds (scalars, or numpy arrays element by element)."""
    return (longer_total - longer * spent) / longer


def _held_past(s: Signals, after: float) -> list[tuple[int, int]]:
    """(position, context) of the holders past `after` seconds in a tool call."""
    past = s.tools.held_past(after)
    return past[: bisect.bisect_left(past, (s.contexts.held,))]


def _aimd_fallback(fallback: AIMD, s: Signals) -> Decision:
    """`wset`'s and `wset2`'s law where the engine reports no pool size."""
    d = fallback.update(s)
    return Decision(d.window, f"aimd-fallback:{d.branch}")


def _cut_or_fit(s: Signals, fit: int, max_recompute: float, beta: float) -> Decision:
    """The fitted window, cut by `beta` while the recompute rate is above `max_recompute`."""
    fit = max(1, fit)
    if s.recompute_rate is not None and s.recompute_rate > max_recompute:
        return Decision(max(1, min(fit, math.floor(s.window * beta))), "cut:recompute")
    return Decision(fit, "fit")


def _check_fit_params(name: str, headroom_steps: float, max_recompute: float, beta: float) -> None:
    """The checks `wset` and `wset2` share."""
    if headroom_steps < 0:
        raise ValueError(f"{name} headroom_steps must be >= 0, got {headroom_steps!r}")
    if not 0.0 < max_recompute <= 1.0:
        raise ValueError(f"{name} max_recompute must be in (0, 1], got {max_recompute!r}")
    if not 0.0 < beta <= 1.0:  # 1: no cut on recompute
        raise ValueError(f"{name} beta must be in (0, 1], got {beta!r}")


def _capacity(s: Signals, use_host: bool) -> float:
    """The device pool, plus the host tier where the engine has one and reloading from it is
    cheaper than recomputing (an agent whose KV went to host comes back for a PCIe copy
    instead of a prefill): the part of it beyond the device's own copies, since
    write-through keeps a host copy of what the device holds."""
    device = float(s.capacity_tokens or 0)
    if not use_host or not s.host_capacity_tokens or s.host_reload_cost is None:
        return device
    extra = max(0.0, s.host_capacity_tokens - device)
    return device + (extra if s.host_reload_cost < 1.0 else 0.0)


def _resume_cap(s: Signals, host_counted: bool, share: float) -> int | None:
    """The most slot holders after this period such that the paused agents it resumes can
    reload their contexts within `share` of the period's host-to-device link time (None: no
    cap). A paused agent's KV went to the host tier; it comes back when the agent's next
    request is admitted, inside that prefill, and a prefill whose reloads outlast its forward
    stalls every running request's decode for the rest. Resumed in a burst, their reloads
    contend; capped per period they are spread out. Pending agents (never admitted) have
    nothing to reload, and the shared prefix stays on the device; at least one resumes."""
    per, period = s.host_reload_token_seconds, s.period_seconds
    if not host_counted or not per or not period:
        return None
    contexts, shared = s.contexts, s.shared_tokens or 0
    held = contexts.held
    resumable = len(contexts) - held - s.pending  # the paused waiters come first
    if resumable <= 1:
        return None
    tokens = share * period / per
    base = contexts.total(held)

    def reload(j: int) -> float:  # tokens the first j paused waiters bring back
        return max(0.0, contexts.total(held + j) - base - j * shared)

    if reload(resumable) <= tokens:
        return None
    j = bisect.bisect_right(range(resumable + 1), tokens, key=reload) - 1
    return held + max(1, j)


def _reserved_budget(s: Signals, capacity: float, reserve: float, host_counted: bool) -> float:
    """`wset2`'s tokens for the working set: `capacity` less its `reserve` share, which a
    host tier counted in `capacity` waives while every agent's context (holders and
    waiters, the shared prefix once) fits both tiers: then nobody needs to wait, since
    overflowing the device costs reloads, not recomputes. Once the contexts exceed the
    tiers, agents rotate through the window and each one paused or finished leaves KV that
    the host store's LRU keeps over a live agent's: the reserve absorbs it, as on the device.
    (Kept in proportion to the excess instead, reaching the full share at 1.1x or 2x the
    tiers, Qwen TP2 took 1,990 / 2,015 s against 1,967 s: docs/policies.md.)"""
    if not host_counted:
        return (1.0 - reserve) * capacity
    contexts, shared = s.contexts, s.shared_tokens or 0
    everyone_fits = contexts.fit(capacity - shared, 0.0, shared) >= len(contexts)
    return capacity if everyone_fits else (1.0 - reserve) * capacity


def _fit_dropping(
    contexts: Contexts, budget: float, extra: float, shared: int, held: list[tuple[int, int]]
) -> int:
    """`contexts.fit(budget, extra, shared)` where the holders at the `held` (position,
    context) pairs (by position) count 0 (their KV dropped). With D[j] the terms of the
    first j dropped holders, a prefix that has passed exactly j of them fits iff its plain
    total is within budget + D[j]; whether the fit passes the j-th dropped holder only turns
    from yes to no as j grows, so the number it passes is found by bisection (each probe one
    `fit`: running totals, no sort), and the count is `fit(budget + D[j])` past the last one
    passed. The fit is prepared once for all the probes (`contexts.fitter`)."""
    if budget < 0:
        return 0
    fit = contexts.fitter(extra, shared)
    if not held:
        return fit(budget)
    dropped = list(map(operator.itemgetter(0), held))
    lift = list(itertools.accumulate(_dropped_terms(held, extra, shared), initial=0.0))
    counts: dict[int, int] = {}  # fit(budget + lift[j]) by j: the last probe is often the answer

    def fit_past(j: int) -> int:
        if j not in counts:
            counts[j] = fit(budget + lift[j])
        return counts[j]

    # whether the prefix just short of the j-th dropped holder fits
    j = bisect.bisect_left(range(len(dropped)), True, key=lambda j: fit_past(j) < dropped[j])
    low = dropped[j - 1] + 1 if j else 0
    high = dropped[j] if j < len(dropped) else len(contexts)
    return min(max(fit_past(j), low), high)


def _dropped_terms(held: list[tuple[int, int]], extra: float, shared: int) -> Iterator[float]:
    """Each dropped holder's term, max(c, shared) - shared + extra, mapped in C: where no
    context is below `shared`, max(c, shared) - shared is the int c - shared (the same
    value; builtin max called per element would cost more than the rest)."""
    contexts = list(map(operator.itemgetter(1), held))
    floored: Iterator[int]
    if contexts and min(contexts) >= shared:
        floored = map(operator.sub, contexts, itertools.repeat(shared))
    else:
        floored = (max(c, shared) - shared for c in contexts)
    return map(operator.add, floored, itertools.repeat(extra))


# Registered policies by name. A policy's parameters are its dataclass fields; a new policy
# is one class added here, and `--policy NAME:key=value,...` and --help know it at once.
_POLICIES: tuple[type[Policy], ...] = (AIMD, WorkingSet, WorkingSet2, NoGate, AgentCap, RequestCap)
REGISTRY: dict[str, type[Policy]] = {cls.name: cls for cls in _POLICIES}
# The AIMD flags (--alpha, ...) set AIMD's parameters: of `aimd` itself, and of the AIMD a
# policy falls back on (its field of type AIMD). Other policies take none.
_AIMD_OPTIONS = tuple(f.name for f in dataclasses.fields(AIMD))
_FLAG_NAMES = {"initial": "initial_window"}  # where the flag's name is not the field's


def _fields(cls: type[Policy]) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(cls)  # type: ignore[arg-type]  # every policy is a dataclass


def parameters(cls: type[Policy]) -> dict[str, tuple[type, Any]]:
    """A policy's settable parameters: name -> (type, default or MISSING), in field order."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, Any]] = {}
    for f in _fields(cls):
        if hints[f.name] is AIMD:  # the fallback: set through the AIMD flags
            continue
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        out[f.name] = (hints[f.name], default)
    return out


def describe(cls: type[Policy]) -> str:
    """`name:key=default,...` for help texts; a parameter without default shows as <key>,
    an optional one whose default depends on others (None) as [key]."""
    items = [
        f"<{k}>" if d is dataclasses.MISSING else f"[{k}]" if d is None else f"{k}={d}"
        for k, (_, d) in parameters(cls).items()
    ]
    return cls.name + (":" + ",".join(items) if items else "")


def make_policy(spec: str, **aimd_options: Any) -> Policy:
    """Build a policy from `name` or `name:args`, where args are comma-separated `key=value`
    pairs of the policy's parameters (a policy with one parameter without default also takes
    it bare: `agent-cap:32`). `aimd_options` are the AIMD flags (None: not given). Unknown
    keys, bad values and options the policy does not take are errors naming them."""
    name, _, arg = spec.partition(":")
    cls = REGISTRY.get(name)
    if cls is None:
        known = ", ".join(describe(c) for c in REGISTRY.values())
        raise ValueError(f"unknown policy {name!r}; registered: {known}")
    params = parameters(cls)
    values = _parse_args(cls, params, arg)
    given = {k: v for k, v in aimd_options.items() if v is not None}
    bad = [k for k in given if k not in _AIMD_OPTIONS]
    if bad:
        raise ValueError(f"unknown AIMD option(s) {bad}; valid: {', '.join(_AIMD_OPTIONS)}")
    hints = typing.get_type_hints(cls)
    fallback = [f.name for f in _fields(cls) if hints[f.name] is AIMD]
    if given and cls is AIMD:
        twice = sorted(set(given) & set(values))
        if twice:
            raise ValueError(f"policy aimd: {twice} given both as a flag and in --policy")
        values = {**given, **values}
    elif given and fallback:
        values[fallback[0]] = AIMD(**given)
    elif given:
        flags = ", ".join("--" + _FLAG_NAMES.get(k, k).replace("_", "-") for k in given)
        raise ValueError(f"{flags}: AIMD options, which policy {name!r} does not take")
    missing = [k for k, (_, d) in params.items() if d is dataclasses.MISSING and k not in values]
    if missing:
        raise ValueError(f"policy {name!r} needs {missing}: e.g. --policy {describe(cls)}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: {e}") from None


def _parse_args(cls: type[Policy], params: dict[str, tuple[type, Any]], arg: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    items = [a.strip() for a in arg.split(",")] if arg else []
    required = [k for k, (_, d) in params.items() if d is dataclasses.MISSING]
    for i, item in enumerate(items):
        key, eq, text = item.partition("=")
        if not eq:  # a bare value: the one parameter without default
            if i > 0 or len(required) != 1:
                raise ValueError(
                    f"policy {cls.name!r}: {item!r} is not key=value; valid keys: "
                    f"{', '.join(params) or '(none)'}"
                )
            key, text = required[0], item
        key = key.strip()
        if key not in params:
            raise ValueError(
                f"policy {cls.name!r} has no parameter {key!r}; valid: "
                f"{', '.join(params) or '(none)'}"
            )
        if key in values:
            raise ValueError(f"policy {cls.name!r}: {key!r} given twice")
        values[key] = _convert(cls.name, key, params[key][0], text.strip())
    return values


def _convert(policy: str, key: str, kind: Any, text: str) -> Any:
    """`text` as the parameter's type (int, float, bool, or one of them | None)."""
    options = (
        typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType)
        else (kind,)
    )
    if type(None) in options and text.lower() == "none":
        return None
    for t in options:
        try:
            if t is bool:
                if text.lower() in ("true", "1", "yes", "false", "0", "no"):
                    return text.lower() in ("true", "1", "yes")
                continue
            if t in (int, float, str):
                return t(text)
        except ValueError:
            continue
    names = "/".join(getattr(t, "__name__", str(t)) for t in options)
    raise ValueError(f"policy {policy!r}: {key}={text!r} is not a valid {names}")
