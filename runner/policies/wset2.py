"""`wset2`: the working-set policy with tool-call awareness, coalescing and a fair order
(docs/policies.md). The default: within 2% of the best baseline on more generated workloads
than any other policy, though not on the 97% issue 31 asks (docs/policies.md, "Where the
policies stand"). numpy is needed here only."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import operator
import types
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from .aimd import AIMD
from .fit import _aimd_fallback, _capacity, _check_fit_params, _cut_or_fit
from .protocol import Coalesce, Contexts, Decision, Order, PauseRule, ResumeRule, Signals, Unit

# Spread the waiting: pause who has waited least, resume who has waited most (wset2 `fair_below`)
FAIR = Order("least-waited", "most-waited")


@dataclass(frozen=True)
class WorkingSet2:
    """Fits the agents' contexts to the KV pool less a reserve; drops KV held in long tools.

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
      hold is recomputed too, so the cost stays a recompute's. Never before the median call
      has ended (`drop_after_median`): a call shorter than that is most likely a typical one,
      and a mixture of short calls and rare long ones makes the mean remainder of a call
      just begun long (the long ones' share), so every holder would be dropped as its call
      began, the short calls' returns recomputed for a few seconds of pool.
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
    # while holders' KV is dropped, no cut for the recompute their returns cause
    trust_drops: bool = True
    # no holder dropped before the median tool call has ended
    drop_after_median: bool = True
    fallback: AIMD = AIMD()

    name: ClassVar[str] = "wset2"
    # LIFO both ways: the agent paused last is the likeliest to find its KV still cached
    rules: ClassVar[tuple[PauseRule, ResumeRule]] = ("newest", "newest")
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
        dropping = False
        if after is not None:  # holders in calls past it count nothing
            dropping = s.tools.count_past(after) > 0
            fit = s.tools.fit_dropping(contexts, after, budget, growth, shared)
            if fit is None:
                fit = _fit_dropping(contexts, budget, growth, shared, _held_past(s, after))
        else:
            fit = contexts.fit(budget, growth, shared)
        if s.resident_limit is not None:  # the engine keeps fewer contexts than fit its tokens
            fit = min(fit, s.resident_limit)
        if dropping and self.trust_drops:
            # the recompute that dropped holders cause when they return is the trade's price,
            # not a sign that the fit overestimates the pool: no cut for it
            d = Decision(max(1, fit), "fit:dropping")
        else:
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
        recompute seconds), and not before the median call's duration. With a host tier
        counted in `capacity`, a context the tiers cannot hold is recomputed, not reloaded,
        so the cost is a recompute's either way."""
        if calls is None or not per:
            return None
        after = calls.first_above(self.drop_factor * capacity * per)
        return max(after, calls.median()) if self.drop_after_median else after

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


# Its public name, for code outside the policy (bench/common/gate_scenarios.py counts the
# holders wset2 drops with it); the policy and its tests use the private one.
RemainingTime = _RemainingTime


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
