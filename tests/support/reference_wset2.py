"""wset2's tool-call path as it was before the gate kept the holders' calls in order (main at
87b21e9, runner/policies/protocol.py): the holders' seconds in a tool and the finished calls'
durations as tuples rebuilt every period, the durations sorted and their mean excess scanned
in Python, the dropped holders picked by a pass over every holder, and `_fit_dropping`
walking the holders. Kept verbatim (as a function of the tuples) as the reference that
tests/policies/test_wset2_paths.py holds the new path to: the same decisions.
"""
# ruff: noqa

from __future__ import annotations

import bisect
import itertools
import math

from runner.policies.protocol import Contexts, Decision, Signals
from runner.policies.wset2 import WorkingSet2
from runner.policies.fit import _aimd_fallback, _capacity, _cut_or_fit


def update(
    self: WorkingSet2,
    s: Signals,
    held_tool_seconds: tuple[float, ...],
    tool_durations: tuple[float, ...],
) -> Decision:
    if not s.capacity_tokens:
        return _aimd_fallback(self.fallback, s)
    growth = (s.growth_per_step or 0.0) * self.headroom_steps
    shared = s.shared_tokens or 0
    capacity = _capacity(s, self.use_host)
    budget = (1.0 - self.reserve) * capacity - shared  # the shared prefix, stored once
    contexts = s.contexts
    after = _drop_after(self, s, capacity, tool_durations)
    if after is not None:  # holders in calls past it count nothing
        # t > 0 and t >= after, compared in C (after >= 0: past 0, t > 0 alone)
        past = after.__le__ if after > 0 else (0.0).__lt__
        tools = itertools.islice(held_tool_seconds, contexts.held)
        dropped = list(itertools.compress(itertools.count(), map(past, tools)))
        fit = _fit_dropping(contexts, budget, growth, shared, dropped)
        if dropped and self.trust_drops:  # their returns' recompute is the trade's price
            return Decision(max(1, fit), "fit:dropping")
    else:
        fit = contexts.fit(budget, growth, shared)
    return _cut_or_fit(s, fit, self.max_recompute, self.beta)


def _drop_after(
    self: WorkingSet2, s: Signals, capacity: float, tool_durations: tuple[float, ...]
) -> float | None:
    if not s.recompute_token_seconds or not tool_durations:
        return None
    break_even = self.drop_factor * capacity * s.recompute_token_seconds
    after = _RemainingTime(tool_durations).first_above(break_even)
    if not self.drop_after_median:
        return after
    ordered = sorted(tool_durations)
    return max(after, ordered[len(ordered) // 2])  # the median call (of two, the upper)


class _RemainingTime:
    def __init__(self, durations: tuple[float, ...]) -> None:
        self._d = sorted(durations)
        self._suffix = [*reversed(list(itertools.accumulate(reversed(self._d)))), 0.0]

    def expected(self, spent: float) -> float:
        i = bisect.bisect_right(self._d, spent)
        n = len(self._d) - i
        return spent if n == 0 else (self._suffix[i] - n * spent) / n

    def first_above(self, x: float) -> float:
        d, suffix, m = self._d, self._suffix, len(self._d)
        if m and suffix[0] / m > x:
            return 0.0
        for j, t in enumerate(d):  # just past d[j]: the calls longer than t
            if j + 1 < m and d[j + 1] == t:
                continue  # ties: the last of equal durations
            n = m - j - 1
            if n and (suffix[j + 1] - n * t) / n > x:
                return t
        # beyond every finished call the expected remainder is the time spent
        if d and d[-1] > x:
            return d[-1]
        return math.nextafter(x, math.inf)


def _fit_dropping(
    contexts: Contexts, budget: float, extra: float, shared: int, dropped: list[int]
) -> int:
    if budget < 0:
        return 0
    if not dropped:
        return contexts.fit(budget, extra, shared)
    mask = bytearray(dropped[-1] + 1)
    for i in dropped:
        mask[i] = 1
    terms = (max(c, shared) - shared + extra for c in itertools.compress(contexts, mask))
    lift = list(itertools.accumulate(terms, initial=0.0))  # lift[j]: the first j dropped

    def passes(j: int) -> bool:  # the prefix just short of the j-th dropped holder fits
        return contexts.fit(budget + lift[j], extra, shared) >= dropped[j]

    j = bisect.bisect_left(range(len(dropped)), True, key=lambda j: not passes(j))
    low = dropped[j - 1] + 1 if j else 0
    high = dropped[j] if j < len(dropped) else len(contexts)
    return min(max(contexts.fit(budget + lift[j], extra, shared), low), high)
