"""The gate's agents in the order a policy reads them, with running totals of their contexts.

The order (what `Gate.contexts()` hands a policy): the slot holders in the order they keep
their slots (active ones by admission, then marked ones by admission), then the agents
waiting at the gate in the order they would get one (paused ones by the resume rule, then
pending ones in task order).

Each of those four segments is a sorted list of short blocks (the layout of sortedcontainers'
SortedList), and every block keeps the sum of its agents' contexts and a lower bound of the
smallest. An agent knows its block, so the gate's hot path (an admitted agent reporting its
context between steps) updates one sum in O(1); entering or leaving a segment is O(log n + B),
and a run of k agents at a segment's head or tail changes segment as whole blocks (their
blocks go with them: O(k / B + B)); a query (the first k agents' total, how many fit a
budget) accumulates the block sums in C, bisects, and accumulates the items of one block:
O(n / B + B) C steps and O(log n) Python steps, no sort. SortedList itself keeps no
per-block aggregate and gives no handle from an item to its block, which the O(1) hot path
needs.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any, Protocol

LOAD = 128  # block size: blocks split above 2 x LOAD and merge below LOAD / 2

_block = operator.attrgetter("block")
_block_keys = operator.attrgetter("block.keys")
_context = operator.attrgetter("context")
_in_call = operator.attrgetter("in_call")
_call_total = operator.attrgetter("call_total")
_sort_key = operator.attrgetter("sort_key")
_keys = operator.attrgetter("keys")
_low = operator.attrgetter("low")
_total = operator.attrgetter("total")


class Member(Protocol):
    """What the structure needs of an agent (the gate's `_Agent` has these)."""

    context: int
    block: Block  # UNPLACED when in no segment
    sort_key: Any
    in_call: bool  # among `ToolCalls.open` (a holder in a tool call)
    tool_since: float | None  # when its call began


class Block:
    __slots__ = ("call_total", "calls", "items", "keys", "low", "segment", "total")

    def __init__(
        self, segment: Segment | None, items: list[Any], keys: list[Any], calls: bool = True
    ) -> None:
        """`calls`: whether any of `items` may be in a tool call (False: none is, skip them)."""
        self.segment = segment
        self.items = items  # the members, in key order
        self.keys = keys  # their sort keys (unique within a segment)
        contexts = list(map(_context, items))
        self.total = sum(contexts)
        self.low = min(contexts, default=0)  # <= every member's context
        # the members in a tool call (`in_call`): how many, and their contexts summed (what
        # `ToolsView.fit_dropping` reads instead of walking the holders it drops)
        in_call = list(itertools.compress(contexts, map(_in_call, items))) if calls else []
        self.calls, self.call_total = len(in_call), sum(in_call)

    def gain(self, a: Member) -> None:
        """`a` joined this block: its sums."""
        self.total += a.context
        if a.context < self.low:
            self.low = a.context
        if a.in_call:
            self.calls += 1
            self.call_total += a.context

    def take(self, other: Block) -> None:
        """`other`'s members joined this block: its sums."""
        self.total += other.total
        self.low = min(self.low, other.low)
        self.calls += other.calls
        self.call_total += other.call_total

    def refresh_low(self) -> int:
        """The exact smallest context (the bound goes stale when a member leaves or grows)."""
        self.low = min(a.context for a in self.items)
        return self.low


UNPLACED = Block(None, [], [])  # the block of an agent that is in no segment


class Segment:
    """Members sorted by their sort key, in blocks."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self._maxes: list[Any] = []  # each block's last key
        self.size = 0

    def add(self, a: Member, key: Any) -> None:
        a.sort_key = key
        self.size += 1
        if not self.blocks:
            b = Block(self, [a], [key])
            self.blocks.append(b)
            self._maxes.append(key)
            a.block = b
            return
        if key > self._maxes[-1] and len(self.blocks[-1].keys) < 2 * LOAD:
            # the common case (a new holder, a new waiter): at the end; Block.gain written
            # out, as this runs at every admission
            b = self.blocks[-1]
            b.keys.append(key)
            b.items.append(a)
            b.total += a.context
            if a.context < b.low:
                b.low = a.context
            if a.in_call:
                b.calls += 1
                b.call_total += a.context
            a.block = b
            self._maxes[-1] = key
            return
        i = min(bisect.bisect_left(self._maxes, key), len(self.blocks) - 1)
        b = self.blocks[i]
        j = bisect.bisect_left(b.keys, key)
        b.keys.insert(j, key)
        b.items.insert(j, a)
        b.gain(a)
        a.block = b
        if j == len(b.keys) - 1:
            self._maxes[i] = key
        if len(b.keys) > 2 * LOAD:
            self._split(i)

    def remove(self, a: Member) -> None:
        b, key = a.block, a.sort_key
        i = bisect.bisect_left(self._maxes, key)
        j = bisect.bisect_left(b.keys, key)
        del b.keys[j]
        del b.items[j]
        b.total -= a.context
        if a.in_call:
            b.calls -= 1
            b.call_total -= a.context
        a.block = UNPLACED
        self.size -= 1
        if not b.keys:
            del self.blocks[i]
            del self._maxes[i]
            return
        self._maxes[i] = b.keys[-1]
        if len(b.keys) < LOAD // 2 and len(self.blocks) > 1:
            self._merge(i if i + 1 < len(self.blocks) else i - 1)

    def first(self, k: int) -> list[Any]:
        """The first k members, in order."""
        out: list[Any] = []
        for b in self.blocks:
            if len(out) >= k:
                break
            out += b.items[: k - len(out)]
        return out

    def last(self, k: int) -> list[Any]:
        """The last k members, last first."""
        out: list[Any] = []
        for b in reversed(self.blocks):
            if len(out) >= k:
                break
            out += b.items[::-1][: k - len(out)]
        return out

    def __iter__(self) -> Iterator[Any]:
        for b in self.blocks:
            yield from b.items

    def take_first(self, k: int) -> list[Block]:
        """Detach the first k members (all of them if fewer), as whole blocks in key order:
        their members keep their blocks and keys, so a run of agents changes segment in
        O(k / B) block moves (`put`) instead of k removals and insertions."""
        k = min(k, self.size)
        if k <= 0:
            return []
        i, left = 0, k
        while left >= len(self.blocks[i].keys):  # the whole blocks taken
            left -= len(self.blocks[i].keys)
            i += 1
            if i == len(self.blocks):
                break
        if i < len(self.blocks) and left:  # the block the cut falls in: its head goes too
            self._cut(i, left)
            i += 1
        out = self._detach(0, i, k)
        self._coalesce(0, 1)  # what the cut left of its block
        return out

    def take_last(self, k: int) -> list[Block]:
        """Detach the last k members (all of them if fewer), as whole blocks in key order
        (see `take_first`)."""
        k = min(k, self.size)
        if k <= 0:
            return []
        i, left = len(self.blocks), k
        while i and left >= len(self.blocks[i - 1].keys):
            i -= 1
            left -= len(self.blocks[i].keys)
        if left:  # the block the cut falls in: its tail goes too
            self._cut(i - 1, len(self.blocks[i - 1].keys) - left)
        out = self._detach(i, len(self.blocks), k)
        self._coalesce(len(self.blocks) - 1, len(self.blocks))
        return out

    def put(self, blocks: list[Block]) -> bool:
        """Attach blocks detached from a segment (`take_first` / `take_last`), if all their
        keys come before or after all of this one's: True; False (nothing done) if they would
        interleave, and the caller adds the members one by one."""
        if not blocks:
            return True
        first, last = blocks[0].keys[0], blocks[-1].keys[-1]
        if self.blocks and not (first > self._maxes[-1] or last < self.blocks[0].keys[0]):
            return False
        for b in blocks:
            b.segment = self
            self.size += len(b.keys)
        maxes = [b.keys[-1] for b in blocks]
        if self.blocks and last < self.blocks[0].keys[0]:
            self.blocks[:0], self._maxes[:0] = blocks, maxes
            self._coalesce(0, len(blocks) + 1)  # the blocks put, and where they meet
        else:
            at = len(self.blocks)
            self.blocks += blocks
            self._maxes += maxes
            self._coalesce(at - 1, len(self.blocks))
        return True

    def _coalesce(self, i: int, j: int) -> None:
        """Blocks i..j-1 (clamped) under LOAD / 2 join their next block (the last one its
        previous): only the small block's members change block, and a joined block above
        2 x LOAD splits. Keeps runs moved by `take_*` and `put` from leaving a trail of tiny
        blocks that every fit would walk."""
        i = max(0, i)
        while i < min(j, len(self.blocks)) and len(self.blocks) > 1:
            b = self.blocks[i]
            if len(b.keys) >= LOAD // 2:
                i += 1
                continue
            last = i + 1 == len(self.blocks)
            into = self.blocks[i - 1] if last else self.blocks[i + 1]
            for a in b.items:
                a.block = into
            if last:  # appended to its previous block
                into.items += b.items
                into.keys += b.keys
                self._maxes[i - 1] = b.keys[-1]
            else:  # prepended to its next block (whose last key stays)
                into.items[:0] = b.items
                into.keys[:0] = b.keys
            into.take(b)
            del self.blocks[i], self._maxes[i]
            j -= 1
            at = i - 1 if last else i
            if len(into.keys) > 2 * LOAD:
                self._split(at)
                j += 1

    def _cut(self, i: int, at: int) -> None:
        """Split block i after its first `at` members (0 < at < its size). The smaller side
        becomes the new block (its members change block, and its sum and bound are
        computed); the other keeps its block, and its bound, still below its members."""
        b = self.blocks[i]
        if at <= len(b.keys) // 2:  # the head leaves
            part = Block(self, b.items[:at], b.keys[:at], b.calls > 0)
            del b.items[:at], b.keys[:at]
            self.blocks.insert(i, part)
            self._maxes.insert(i, part.keys[-1])
        else:  # the tail leaves
            part = Block(self, b.items[at:], b.keys[at:], b.calls > 0)
            del b.items[at:], b.keys[at:]
            self.blocks.insert(i + 1, part)
            self._maxes[i] = b.keys[-1]
            self._maxes.insert(i + 1, part.keys[-1])
        b.total -= part.total
        b.calls -= part.calls
        b.call_total -= part.call_total
        for a in part.items:
            a.block = part

    def _detach(self, i: int, j: int, k: int) -> list[Block]:
        """Take blocks i..j-1 (k members in all) out of this segment."""
        out = self.blocks[i:j]
        del self.blocks[i:j], self._maxes[i:j]
        self.size -= k
        for b in out:
            b.segment = None
        return out

    def _split(self, i: int) -> None:
        self._cut(i, len(self.blocks[i].keys) // 2)
        self.blocks[i + 1].refresh_low()  # the half that kept its block (and its old bound)

    def _merge(self, i: int) -> None:
        """Merge block i+1 into block i (then split again if that is too large)."""
        b, nxt = self.blocks[i], self.blocks[i + 1]
        for a in nxt.items:
            a.block = b
        b.items += nxt.items
        b.keys += nxt.keys
        b.take(nxt)
        del self.blocks[i + 1]
        del self._maxes[i]
        if len(b.keys) > 2 * LOAD:
            self._split(i)


class KeepOrder:
    """The gate's four segments, in the order a policy reads them (see the module doc)."""

    def __init__(self) -> None:
        self.active = Segment()  # by admission sequence
        self.marked = Segment()  # by admission sequence
        self.paused = Segment()  # by the resume rule's key
        self.pending = Segment()  # by queue position (task order, then re-queue order)
        self.segments = (self.active, self.marked, self.paused, self.pending)

    def remove(self, a: Member) -> None:
        """Take `a` out of its segment, if it is in one."""
        seg = a.block.segment
        if seg is not None:
            seg.remove(a)


class ContextsView:
    """A read-only view of a `KeepOrder`: the agents' contexts in keep-then-admission order,
    as they are now (a controller reads it within one step; it follows the gate's changes).
    Implements runner.policies.protocol.Contexts."""

    def __init__(self, order: KeepOrder) -> None:
        self._order = order

    @property
    def held(self) -> int:
        """How many of the first agents hold a slot (the rest wait)."""
        return self._order.active.size + self._order.marked.size

    def __len__(self) -> int:
        return sum(s.size for s in self._order.segments)

    def __iter__(self) -> Iterator[int]:
        for b in self._blocks():
            for a in b.items:
                yield a.context

    def total(self, k: int) -> int:
        """The sum of the first k contexts."""
        s = 0
        for b in self._blocks():
            if k <= 0:
                break
            if len(b.keys) <= k:
                s += b.total
            else:
                s += sum(a.context for a in b.items[:k])
            k -= len(b.keys)
        return s

    def fit(self, budget: float, extra: float = 0.0, shared: int = 0) -> int:
        """How many of the first agents fit `budget`, each counted as
        max(0, context - shared) + extra: runner.policies.protocol.ContextList.fit on the same
        contexts, with the same float operations at every prefix."""
        return self.fitter(extra, shared)(budget)

    def fitter(self, extra: float = 0.0, shared: int = 0) -> Callable[[float], int]:
        """`fit` for one `extra` and `shared` and any budget: the block sums are accumulated
        (in C) once, and each budget finds the block where it runs out by bisection, then
        walks that block (each block walked once, however many budgets end in it)."""
        if extra < 0:
            raise ValueError(f"extra must be >= 0 (each agent's term >= 0), got {extra!r}")
        return _Fit(self._blocks(), extra, shared)

    def _blocks(self) -> list[Block]:
        active, marked, paused, pending = self._order.segments
        return [*active.blocks, *marked.blocks, *paused.blocks, *pending.blocks]


class _Fit:
    """ContextsView.fit at a fixed `extra` and `shared` (see there)."""

    def __init__(self, blocks: list[Block], extra: float, shared: int) -> None:
        self._blocks, self._shared = blocks, shared
        self._per = extra - shared  # each term is max(context, shared) + per
        if not blocks:
            return
        if min(map(_low, blocks)) >= shared:
            self._sums = list(itertools.accumulate(map(_total, blocks)))
        else:  # some bound is below the shared prefix: such blocks sum max(context, shared)
            self._sums = list(itertools.accumulate(_floored(b, shared) for b in blocks))
        self._ks = list(itertools.accumulate(map(len, map(_keys, blocks))))
        self._inner: dict[int, list[int]] = {}  # a block's running sums, once walked

    def __call__(self, budget: float) -> int:
        blocks, per = self._blocks, self._per
        if not blocks or budget < 0:
            return 0
        sums, ks = self._sums, self._ks
        # the whole blocks within the budget (the running sums grow monotonically)
        j = bisect.bisect_right(range(len(blocks)), budget, key=lambda j: sums[j] + ks[j] * per)
        if j == len(blocks):
            return ks[-1]
        # in that block, the prefixes within the budget, the same way
        k = ks[j - 1] if j else 0
        inner = self._inner.get(j)
        if inner is None:
            b, shared = blocks[j], self._shared
            values = map(_context, b.items) if b.low >= shared else _floor(b.items, shared)
            inner = list(itertools.accumulate(values, initial=sums[j - 1] if j else 0))
            self._inner[j] = inner
        return k + bisect.bisect_right(
            range(1, len(inner)), budget, key=lambda i: inner[i] + (k + i) * per
        )


def _floor(items: list[Any], shared: int) -> Iterator[int]:
    return (max(a.context, shared) for a in items)


def _floored(b: Block, shared: int) -> int:
    """The block's sum of max(context, shared) (its lower bound refreshed where it is low)."""
    if b.low >= shared or b.refresh_low() >= shared:
        return b.total
    return sum(max(a.context, shared) for a in b.items)
