"""The slot holders' tool calls, as a policy that asks for them reads them (`wants_tools`:
today only the wset2 experiment): who is in a call and since when, the latest calls'
durations, and what fits the pool if the longest calls' contexts were dropped."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .gate_order import (
    Block,
    ContextsView,
    KeepOrder,
    _block,
    _block_keys,
    _call_total,
    _context,
    _floor,
    _floored,
    _in_call,
    _keys,
    _low,
    _sort_key,
    _total,
)


class ToolCalls:
    """The slot holders in a tool call, oldest call first, and the latest finished calls'
    durations, kept sorted: what `ToolsView` answers from without a walk of the holders or a
    sort. A call begins at the agent's `done_request` and ends at its next `acquire`; the
    gate's clock only moves forward, so calls join at the end (an out-of-order one, which
    only a protocol break can make, re-sorts them: see `begin`)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        # holders in a call -> when it began (an insertion-ordered dict: O(1) to join, to
        # leave, and to walk from either end; its deleted slots are compacted as it grows)
        self.open: dict[Any, float] = {}
        # the same starts, sorted: how many calls began by a time is one bisection
        self.starts = array("d")
        self._latest = -math.inf  # the latest call start seen (when calls began in order)
        self.finished: deque[float] = deque()  # the latest `kept` durations, oldest first
        self.ascending = array("d")  # the same, sorted

    def begin(self, a: Any) -> None:
        """Holder `a` is in a call since `a.tool_since` (re-begun: it moves to its new place).
        Its block counts it among its members in a call (`Block.calls`); an agent not placed
        yet is counted when it joins a segment."""
        if a.in_call:
            self._forget(a)
        else:
            a.in_call = True
            if a.block.segment is not None:
                a.block.calls += 1
                a.block.call_total += a.context
        self.open[a] = a.tool_since
        bisect.insort(self.starts, a.tool_since)
        if a.tool_since >= self._latest:
            self._latest = a.tool_since
        else:  # a call older than the latest: keep the oldest first (stable on ties)
            self.open = dict(sorted(self.open.items(), key=operator.itemgetter(1)))

    def end(self, a: Any) -> None:
        """`a` is in no call, or holds no slot any more (before its context changes: its
        block's sum of those in a call has it)."""
        if not a.in_call:
            return
        a.in_call = False
        self._forget(a)
        if a.block.segment is not None:
            a.block.calls -= 1
            a.block.call_total -= a.context

    def _forget(self, a: Any) -> None:
        """Take `a`'s call out of `open` and `starts`."""
        since = self.open.pop(a)
        del self.starts[bisect.bisect_left(self.starts, since)]

    def begun_by(self, past: Callable[[float], bool], near: float) -> int:
        """How many calls `past` holds of by their start (it holds of the earliest ones:
        true up to some start, false from it on), `near` being about the start where it
        turns. Found by a bisection of the starts by value, checked by `past` on either side
        (two calls of it where a bisection by `past` makes ~10); where roundings or equal
        starts put the turn elsewhere, by a bisection by `past`."""
        starts = self.starts
        i = bisect.bisect_right(starts, near)
        if (i == 0 or past(starts[i - 1])) and (i == len(starts) or not past(starts[i])):
            return i
        return bisect.bisect_left(starts, True, key=lambda since: not past(since))

    def done(self, seconds: float) -> None:
        """A call finished after `seconds`."""
        if len(self.finished) == self.kept:
            old = self.finished.popleft()
            del self.ascending[bisect.bisect_left(self.ascending, old)]
        self.finished.append(seconds)
        bisect.insort(self.ascending, seconds)


class ToolsView:
    """The holders' tool calls as a policy reads them (runner.policies.protocol.Tools), at
    the instant it was made: `held_past` walks only the holders it returns (the calls begun
    longest ago) and finds their places in the keep order through their blocks; `durations` copies a
    sorted array; `fit_dropping` reads the blocks' sums (of all their members and of those
    in a call) and sums the contexts of only the fewer of the holders past the time and
    those in a call short of it."""

    def __init__(self, order: KeepOrder, calls: ToolCalls, now: float) -> None:
        self._order, self._calls, self._now = order, calls, now

    def durations(self) -> Sequence[float]:
        return self._calls.ascending[:]

    def held_past(self, seconds: float) -> list[tuple[int, int]]:
        # oldest call first, so the longest in a tool first: the first n
        n = self._calls.begun_by(self._past(seconds), self._turn(seconds))
        if not n:
            return []
        past = list(itertools.islice(self._calls.open, n))
        starts, at = {}, 0  # where each holder block begins among the holders
        for seg in (self._order.active, self._order.marked):
            for b in seg.blocks:
                starts[b] = at
                at += len(b.keys)
        # each one's place: its block's start plus its place in the block (mapped in C)
        places = map(bisect.bisect_left, map(_block_keys, past), map(_sort_key, past))
        where = map(operator.add, map(starts.__getitem__, map(_block, past)), places)
        return sorted(zip(where, map(_context, past), strict=True))

    def count_past(self, seconds: float) -> int:
        # one bisection over the calls' starts: `held_past` without placing anyone
        return self._calls.begun_by(self._past(seconds), self._turn(seconds))

    def fit_dropping(
        self, contexts: Any, seconds: float, budget: float, extra: float = 0.0, shared: int = 0
    ) -> int | None:
        """runner.policies.wset2._fit_dropping(contexts, budget, extra, shared,
        held_past(seconds)): how many of the first agents fit `budget` when the holders past
        `seconds` in a call count 0, each other max(0, context - shared) + extra. From the
        blocks' sums, without placing each dropped holder in the keep order: near the
        holders' end where the budget runs out there (`_fit_near_turn`), else by block
        (`_FitPast`). None where it cannot answer so: `contexts` is not this gate's view,
        or the count is within rounding of a tie (the caller then takes the
        holder-by-holder path, whose float sums decide it)."""
        if extra < 0:
            raise ValueError(f"extra must be >= 0 (each agent's term >= 0), got {extra!r}")
        if not isinstance(contexts, ContextsView) or contexts._order is not self._order:
            return None
        if budget < 0:
            return 0
        n = self._calls.begun_by(self._past(seconds), self._turn(seconds))
        if not n:
            return contexts.fit(budget, extra, shared)
        near = _fit_near_turn(self._order, self._calls, n, budget, extra, shared)
        if not isinstance(near, _Far):
            return near
        return _FitPast(contexts._blocks(), *self._dropped(n), extra, shared)(budget)

    def _past(self, seconds: float) -> Callable[[float], bool]:
        """Whether a call begun at a time is past `seconds` now (held_past's test): true for
        the calls begun first, false from some start on (the clock only moves forward)."""
        now = self._now

        def past(since: float) -> bool:
            t = now - since
            return t > 0 and t >= seconds

        return past

    def _turn(self, seconds: float) -> float:
        """About the start from which a call is not past `seconds` now (`_past` turns there,
        but for roundings): `seconds` ago, or now where `seconds` <= 0 (only the calls begun
        before now are past it then)."""
        return self._now - max(seconds, 0.0)

    def _dropped(self, n: int) -> tuple[list[int], list[int], float]:
        """The n holders past the time in a call (`begun_by`): how many, and their contexts
        summed, in each holder block (active, then marked: the keep order's first blocks),
        and the latest start among their calls. They are the calls begun first
        (`held_past`), so a call is past the time iff it began by that latest start (one
        comparison where `_past` makes a call). Counted from those where they are the
        fewer, else from the blocks' sums of their members in a call (`Block.calls`,
        `call_total`) less the holders in a call short of the time."""
        calls = self._calls.open
        blocks = [*self._order.active.blocks, *self._order.marked.blocks]
        if n <= len(calls) - n:
            by = _by_block(itertools.islice(calls, n))
            counts = [by.get(b, _NONE)[0] for b in blocks]
            sums = [by.get(b, _NONE)[1] for b in blocks]
        else:  # all of a block's members in a call, less those short of the time
            by = _by_block(itertools.islice(reversed(calls), len(calls) - n))
            counts = [b.calls - by.get(b, _NONE)[0] for b in blocks]
            sums = [b.call_total - by.get(b, _NONE)[1] for b in blocks]
        return counts, sums, self._calls.starts[n - 1]


# holder blocks `ToolsView.fit_dropping` walks back from the last one (`_fit_near_turn`)
# before it takes the per-block counts (`_FitPast`)
WALK_BACK = 3
# ... or, where the blocks with dropped members are known (few calls past the time), this
# many (the marked holders' blocks, and the last active ones)
WALK_BACK_KNOWN = 32
# members of the block where the budget runs out summed first from its end (`within_back`),
# then twice as many, and so on
TAIL = 32


class _Far:
    """`_fit_near_turn`'s answer where the budget runs out further back than it looks."""


_FAR = _Far()
_NONE = (0, 0)  # no dropped member in a block: how many, their contexts summed


def _by_block(members: Iterable[Any]) -> dict[Block, list[int]]:
    """Holders in a call, by block: how many, and their contexts summed."""
    out: dict[Block, list[int]] = {}
    for a in members:
        got = out.get(a.block)
        if got is None:
            out[a.block] = [1, a.context]
        else:
            got[0] += 1
            got[1] += a.context
    return out


def _fit_near_turn(
    order: KeepOrder, calls: ToolCalls, n: int, budget: float, extra: float, shared: int
) -> int | _Far | None:
    """`_FitPast`'s answer (the n calls begun first being past the time, `budget` >= 0)
    where the budget runs out among the waiters or in the last holder blocks (`back_from`):
    in nearly every period, since the window follows the fit and the gate marks or admits
    the agents about there. Needs no count per block (`_dropped`: a dict of the blocks and
    a Python loop over the fewer of the calls past the time and short of it, most of a
    period's fit where those short of it are the fewer): the holders' totals are the
    blocks' sums less the past calls' contexts (summed in C from the fewer side), the last
    holder blocks are taken off them one by one (their dropped members found by their
    calls, or, where the past calls are the fewer, counted by block in one loop over
    those), and the waiters have none dropped. The same integers as `_FitPast`, so the
    same count or None; `_FAR` where the budget runs out further back, or some context may
    be below `shared` (`_FitPast` floors those)."""
    active, marked, paused, pending = order.segments
    holders, waiters = [*active.blocks, *marked.blocks], [*paused.blocks, *pending.blocks]
    if min(map(_low, holders), default=shared) < shared or (
        min(map(_low, waiters), default=shared) < shared
    ):
        return _FAR
    held, held_total = active.size + marked.size, sum(map(_total, holders))
    everyone = held + paused.size + pending.size
    terms = _Terms(
        extra, shared, calls.starts[n - 1], everyone, held_total + sum(map(_total, waiters))
    )
    past = calls.open  # oldest call first: the n past the time, then those short of it
    # by block, where the past calls are the fewer: how many, and their contexts summed
    with_past: dict[Block, list[int]] | None = None
    if n <= len(past) - n:
        with_past = _by_block(itertools.islice(past, n))
        lost = sum(map(_context, itertools.islice(past, n)))
    else:
        short = itertools.islice(reversed(past), len(past) - n)
        lost = sum(map(_call_total, holders)) - sum(map(_context, short))
    # through the holders: the integer part of the totals of those not dropped, their count
    t, m = held_total - held * shared - (lost - n * shared), held - n
    total = t + m * extra
    if total <= budget:
        return terms.among_waiters(waiters, budget, held, t, m)
    if total > budget:
        return terms.back_from(holders, budget, held, t, m, with_past)
    return _FAR  # a NaN


class _Terms:
    """The fit's terms (each agent not dropped counts max(c, shared) - shared + extra, the
    dropped ones, in a call begun by `last`, 0), and the guard on the roundings: what
    `_FitPast` and `_fit_near_turn` share. Totals are an integer part plus a count x extra.
    `_fit_dropping` sums the same terms as floats in another order: the two differ at most
    by the roundings of such sums (`checked`), so where the total at the count or just past
    it is that close to the budget, the answer is None and the caller's float sums decide."""

    def __init__(self, extra: float, shared: int, last: float, n: int, total: int) -> None:
        """`n`: every agent; `total`: every agent's max(c, shared) summed."""
        self._extra, self._shared, self._last, self._n = extra, shared, last, n
        # |every sum either path forms| <= this: the budget, all terms, and k x |per|
        self._scale = total + n * (extra + shared)

    def dropped_in(self, items: list[Any]) -> list[int]:
        """The places of a block's dropped members (in a call begun by `last`)."""
        in_call = itertools.compress(itertools.count(), map(_in_call, items))
        return [i for i in in_call if items[i].tool_since <= self._last]

    def among_waiters(
        self, waiters: list[Block], budget: float, before: int, t: int, m: int
    ) -> int | None:
        """The count where the budget runs out among the waiters' blocks (none dropped
        there; `before` agents, totals `t` + `m` x extra, ahead of them)."""
        shared, extra = self._shared, self._extra
        sums = list(itertools.accumulate(map(_total, waiters)))
        ks = list(itertools.accumulate(map(len, map(_keys, waiters))))

        def total(j: int) -> float:  # of the agents through waiter block j
            return t + sums[j] - ks[j] * shared + (m + ks[j]) * extra

        j = bisect.bisect_right(range(len(waiters)), budget, key=total)
        if j == len(waiters):
            return self.checked(
                budget, before + (ks[-1] if ks else 0), total(j - 1) if j else t + m * extra, None
            )
        if j:
            before, t, m = before + ks[j - 1], t + sums[j - 1] - ks[j - 1] * shared, m + ks[j - 1]
        return self.within(waiters[j], [], budget, before, t, m)

    def back_from(
        self,
        holders: list[Block],
        budget: float,
        before: int,
        t: int,
        m: int,
        with_past: dict[Block, list[int]] | None,
    ) -> int | _Far | None:
        """The count where the budget runs out in one of the last holder blocks (`before`
        agents, totals `t` + `m` x extra, through them all: over the budget), each taken
        off in turn. A block's dropped members are found by their calls; `with_past`, where
        the caller has it, gives the blocks that have any, how many and their contexts
        summed, so that only the block where the budget runs out is looked into: then up to
        `WALK_BACK_KNOWN` blocks are walked, else `WALK_BACK`."""
        shared, extra = self._shared, self._extra
        reach = WALK_BACK if with_past is None else WALK_BACK_KNOWN
        for j in range(len(holders) - 1, max(-1, len(holders) - 1 - reach), -1):
            b = holders[j]
            if with_past is None:
                dropped = self.dropped_in(b.items) if b.calls else []
                d, lost = len(dropped), sum(b.items[i].context for i in dropped)
            else:  # the places of its dropped members are looked for below, if needed
                d, lost = with_past.get(b, _NONE)
                dropped = None
            k = len(b.keys)  # (no context below `shared`: each term is c - shared + extra)
            before, t, m = before - k, t - (b.total - k * shared - (lost - d * shared)), m - k + d
            if t + m * extra <= budget:  # the totals through the block before it
                if dropped is None:
                    dropped = self.dropped_in(b.items) if d else []
                end = (t + (b.total - k * shared - (lost - d * shared)), m + k - d)
                return self.within_back(b, dropped, budget, before, *end)
        return _FAR

    def within_back(
        self, b: Block, dropped: list[int], budget: float, before: int, t1: int, m1: int
    ) -> int | None:
        """`within`, from the end of block `b` (totals `t1` + `m1` x extra through it, over
        the budget; through the block before it, within): the running sums of its last
        `TAIL`, 2 x `TAIL`, ... members until the budget is within them, so that where the
        budget runs out near the block's end (as the walk back from the holders' end finds
        it) few members are read. The same integers as `within`: a prefix's totals are the
        block's less its members' after it."""
        extra, shared, items = self._extra, self._shared, b.items
        k, nd = len(items), len(dropped)
        # the dropped members' contexts summed from the e-th of them to the block's end
        on = itertools.accumulate((items[i].context for i in reversed(dropped)), initial=0)
        from_dropped = list(on)[::-1]
        tail = [0]  # the block's last r contexts summed, r = 0, 1, ... (extended as needed)

        def total(i: int) -> float:  # of the agents through the block's first i members
            r, e = k - i, bisect.bisect_left(dropped, i)  # after them: members, dropped
            kept = r - (nd - e)
            return t1 - (tail[r] - from_dropped[e] - kept * shared) + (m1 - kept) * extra

        lo, q = k, TAIL
        while lo:  # the last q members' sums, until the budget is within them
            start = max(0, k - q)
            more = itertools.accumulate(map(_context, reversed(items[start:lo])), initial=tail[-1])
            tail += itertools.islice(more, 1, None)
            lo, q = start, 2 * q
            if total(lo) <= budget:
                break
        i = lo + bisect.bisect_right(range(lo + 1, k + 1), budget, key=total)
        return self.checked(budget, before + i, total(i), total(i + 1))

    def within(
        self, b: Block, dropped: list[int], budget: float, before: int, t0: int, m0: int
    ) -> int | None:
        """The count where block `b` (`before` agents, totals `t0` + `m0` x extra, before
        it; its `dropped` members' places) holds the first total over the budget: its
        members' running sum, less the dropped ones' terms, bisected. The same integers as
        summing each member's term (0 for the dropped), without a list of them and of the
        counts."""
        extra, shared, items = self._extra, self._shared, b.items
        floored = map(_context, items) if b.low >= shared else _floor(items, shared)
        sums = list(itertools.accumulate(floored, initial=0))  # of max(c, shared), the first i
        # the dropped members' max(c, shared) summed before each
        lost = list(itertools.accumulate((sums[i + 1] - sums[i] for i in dropped), initial=0))

        def total(i: int) -> float:  # of the agents through the block's first i members
            d = bisect.bisect_left(dropped, i)  # how many of them are dropped
            return t0 + sums[i] - lost[d] - (i - d) * shared + (m0 + i - d) * extra

        i = bisect.bisect_right(range(1, len(sums)), budget, key=total)
        # total(i) is the total of the count's agents; total(i + 1) of one more (over)
        return self.checked(budget, before + i, total(i), total(i + 1))

    def checked(self, budget: float, count: int, within: float, over: float | None) -> int | None:
        """`count`, unless the total at it (`within`) or just past it (`over`; None: no agent
        past it) is within the two paths' rounding of the budget: then None."""
        slack = (self._n + 8) * 2.0**-50 * (abs(budget) + self._scale)
        if not math.isfinite(slack):  # an infinite budget: nothing to bound the roundings by
            return None
        if count and within > budget - slack:
            return None
        if over is not None and over <= budget + slack:
            return None
        return count


class _FitPast(_Terms):
    """`ToolsView.fit_dropping` on blocks whose dropped members are known by block (where
    `_fit_near_turn` cannot answer). The first k agents' total T(k) is I(k) + m(k) x extra,
    with I(k) the integer sum of max(c, shared) - shared over the members not dropped and
    m(k) their count: found per block from its sums (the dropped ones' sum taken off), so
    the count is a bisection over the blocks' running totals, then one within the block
    where the budget runs out (its dropped members found there by their calls)."""

    def __init__(
        self,
        blocks: list[Block],
        counts: list[int],
        sums: list[int],
        last: float,
        extra: float,
        shared: int,
    ) -> None:
        """`counts`, `sums` and `last`: the dropped members of the first blocks, and the
        latest start of their calls (`_dropped`)."""
        self._blocks, self._counts = blocks, counts
        self._shared, self._last = shared, last  # for `_dropped_floored`, before `_Terms`
        lost: Iterator[int]
        if min(map(_low, blocks)) >= shared:  # every term max(c, shared) is c: from the sums
            floored = map(_total, blocks)
            lost = map(operator.sub, sums, map(operator.mul, counts, itertools.repeat(shared)))
        else:
            floored = map(_floored, blocks, itertools.repeat(shared))
            lost = map(self._dropped_floored, blocks, counts, sums)
        # running sums by block: of max(c, shared), of the agents, of the dropped ones and of
        # their terms' integer parts (these over the holder blocks, where all dropped ones are)
        self._sums = list(itertools.accumulate(floored))
        self._ks = list(itertools.accumulate(map(len, map(_keys, blocks))))
        self._lost_n = list(itertools.accumulate(counts))
        self._lost = list(itertools.accumulate(lost))
        super().__init__(extra, shared, last, self._ks[-1], self._sums[-1])

    def _through(self, j: int) -> tuple[int, int]:
        """Through block j: the integer part of the totals of the agents not dropped, and
        how many they are."""
        h = min(j, len(self._lost) - 1)
        ks = self._ks[j]
        return self._sums[j] - ks * self._shared - self._lost[h], ks - self._lost_n[h]

    def _dropped_floored(self, b: Block, n: int, total: int) -> int:
        """The dropped members' sum of max(c, shared) - shared in block `b` (n of them,
        contexts summed to `total`): from the sums where no context in it is below
        `shared`, else member by member."""
        shared = self._shared
        if not n or b.low >= shared or b.refresh_low() >= shared:
            return total - n * shared
        last = self._last
        return sum(
            max(a.context, shared) - shared for a in b.items if a.in_call and a.tool_since <= last
        )

    def __call__(self, budget: float) -> int | None:
        ks, extra, blocks = self._ks, self._extra, self._blocks
        sums, lost, lost_n, shared = self._sums, self._lost, self._lost_n, self._shared
        holders = len(lost) - 1  # the last holder block (the last with dropped members)

        def total(j: int) -> float:  # of the agents through block j: `_through` written out
            h = min(j, holders)  # (the bisection's key, ~7 calls a fit)
            return sums[j] - ks[j] * shared - lost[h] + (ks[j] - lost_n[h]) * extra

        # the whole blocks within the budget (the totals grow monotonically)
        j = bisect.bisect_right(range(len(blocks)), budget, key=total)
        if j == len(blocks):
            return self.checked(budget, ks[-1], total(j - 1), None)
        # in block j, its members' totals on from the blocks before
        b, before = blocks[j], (ks[j - 1] if j else 0)
        start = self._through(j - 1) if j else (0, 0)
        dropped = self.dropped_in(b.items) if j < len(self._counts) and self._counts[j] else []
        return self.within(b, dropped, budget, before, *start)
