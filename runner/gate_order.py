"""The gate's agents in the order a policy reads them, with running totals of their contexts.

The order (what `Gate.contexts()` hands a policy): the slot holders in the order they keep
their slots (active ones by admission, then marked ones by admission), then the agents
waiting at the gate in the order they would get one (paused ones by the resume rule, then
pending ones in task order).

Each of those four segments is a sorted list of short blocks (the layout of sortedcontainers'
SortedList), and every block keeps the sum of its agents' contexts and a lower bound of the
smallest. An agent knows its block, so the gate's hot path (an admitted agent reporting its
context between steps) updates one sum in O(1); entering or leaving a segment is O(log n + B);
a query (the first k agents' total, how many fit a budget) accumulates the block sums in C,
bisects, and accumulates the items of one block: O(n / B + B) C steps and O(log n) Python
steps, no sort. SortedList itself keeps no per-block aggregate and gives no handle from an
item to its block, which the O(1) hot path needs.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterator
from typing import Any, Protocol

LOAD = 128  # block size: blocks split above 2 x LOAD and merge below LOAD / 2


class Member(Protocol):
    """What the structure needs of an agent (the gate's `_Agent` has these)."""

    context: int
    block: Block  # UNPLACED when in no segment
    sort_key: Any


class Block:
    __slots__ = ("items", "keys", "low", "segment", "total")

    def __init__(self, segment: Segment | None, items: list[Any], keys: list[Any]) -> None:
        self.segment = segment
        self.items = items  # the members, in key order
        self.keys = keys  # their sort keys (unique within a segment)
        self.total = sum(a.context for a in items)
        self.low = min((a.context for a in items), default=0)  # <= every member's context

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
            b = self.blocks[-1]  # the common case (a new holder, a new waiter): at the end
            b.keys.append(key)
            b.items.append(a)
            b.total += a.context
            if a.context < b.low:
                b.low = a.context
            a.block = b
            self._maxes[-1] = key
            return
        i = min(bisect.bisect_left(self._maxes, key), len(self.blocks) - 1)
        b = self.blocks[i]
        j = bisect.bisect_left(b.keys, key)
        b.keys.insert(j, key)
        b.items.insert(j, a)
        b.total += a.context
        if a.context < b.low:
            b.low = a.context
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

    def _split(self, i: int) -> None:
        b = self.blocks[i]
        half = len(b.keys) // 2
        right = Block(self, b.items[half:], b.keys[half:])
        del b.items[half:], b.keys[half:]
        b.total -= right.total
        b.refresh_low()
        for a in right.items:
            a.block = right
        self.blocks.insert(i + 1, right)
        self._maxes[i] = b.keys[-1]
        self._maxes.insert(i + 1, right.keys[-1])

    def _merge(self, i: int) -> None:
        """Merge block i+1 into block i (then split again if that is too large)."""
        b, nxt = self.blocks[i], self.blocks[i + 1]
        for a in nxt.items:
            a.block = b
        b.items += nxt.items
        b.keys += nxt.keys
        b.total += nxt.total
        b.low = min(b.low, nxt.low)
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
    Implements runner.policies.Contexts."""

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
        max(0, context - shared) + extra: runner.policies.ContextList.fit on the same
        contexts, with the same float operations at every prefix. The block sums are
        accumulated in C and the block where the budget runs out found by bisection; then
        that block is walked."""
        if extra < 0:
            raise ValueError(f"extra must be >= 0 (each agent's term >= 0), got {extra!r}")
        blocks = self._blocks()
        if not blocks or budget < 0:
            return 0
        if min(map(_low, blocks)) >= shared:
            sums = list(itertools.accumulate(map(_total, blocks)))
        else:  # some bound is below the shared prefix: such blocks sum max(context, shared)
            sums = list(itertools.accumulate(_floored(b, shared) for b in blocks))
        ks = list(itertools.accumulate(map(len, map(_keys, blocks))))
        per = extra - shared  # each term is max(context, shared) + per
        # the whole blocks within the budget (the running sums grow monotonically)
        j = bisect.bisect_right(range(len(blocks)), budget, key=lambda j: sums[j] + ks[j] * per)
        if j == len(blocks):
            return ks[-1]
        # in that block, the prefixes within the budget, the same way
        b, k = blocks[j], ks[j - 1] if j else 0
        values = map(_context, b.items) if b.low >= shared else _floor(b.items, shared)
        inner = list(itertools.accumulate(values, initial=sums[j - 1] if j else 0))
        return k + bisect.bisect_right(
            range(1, len(inner)), budget, key=lambda i: inner[i] + (k + i) * per
        )

    def _blocks(self) -> list[Block]:
        return [b for seg in self._order.segments for b in seg.blocks]


_context = operator.attrgetter("context")
_keys = operator.attrgetter("keys")
_low = operator.attrgetter("low")
_total = operator.attrgetter("total")


def _floor(items: list[Any], shared: int) -> Iterator[int]:
    return (max(a.context, shared) for a in items)


def _floored(b: Block, shared: int) -> int:
    """The block's sum of max(context, shared) (its lower bound refreshed where it is low)."""
    if b.low >= shared or b.refresh_low() >= shared:
        return b.total
    return sum(max(a.context, shared) for a in b.items)
