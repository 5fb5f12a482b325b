"""The KV pool's bookkeeping: which llama.cpp cells each sequence slot holds, shared or not.

llama.cpp's unified KV cache is one array of cells; a cell holds one token at one position
for a set of sequence ids, and is free when that set is empty. `llama_memory_seq_cp(src,
dst, 0, n)` adds dst to the cells of src's first n positions (sharing, no copy);
`llama_memory_seq_rm(s, n, -1)` takes s off its cells from position n on. This module keeps
the same facts in Python, without llama.cpp, so that the engine knows before each step how
many cells are free, how many the running requests hold and what evicting a slot frees.

Cells are counted by group: the cells one slot computed in one go, positions [start, ...).
Each holder of a group holds a prefix of it, [start, end_h) (sharing and truncation only
ever keep prefixes), so the group occupies max(end_h) - start cells. The engine mirrors every
share / truncate / extend here into llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Group:
    start: int
    ends: dict[int, int] = field(default_factory=dict)  # slot id -> end position held

    @property
    def extent(self) -> int:
        return (max(self.ends.values()) - self.start) if self.ends else 0


@dataclass(eq=False)
class Slot:
    """One llama.cpp sequence id. state: "free" (no cells), "idle" (cells kept for `owner`'s
    next turn, evictable), "busy" (leased to a running request)."""

    id: int
    tokens: list[int] = field(default_factory=list)  # its positions 0..n-1
    groups: list[Group] = field(default_factory=list)  # in position order
    state: str = "free"
    owner: str | None = None
    last_used: int = 0  # a counter, for LRU


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by bisection on slice equality (C-speed compares)."""
    hi = min(len(a), len(b))
    if hi == 0 or a[0] != b[0]:
        return 0
    if a[:hi] == b[:hi]:
        return hi
    lo = 1  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Pool:
    def __init__(self, capacity: int, n_slots: int) -> None:
        if capacity < 1 or n_slots < 1:
            raise ValueError(f"a pool needs cells and slots (got {capacity}, {n_slots})")
        self.capacity = capacity
        self.slots = [Slot(i) for i in range(n_slots)]
        self.used = 0
        self._clock = 0

    # ---- queries ----------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def held_by_busy(self) -> int:
        """Cells held by busy slots (shared cells once): SGLang's token_usage numerator."""
        return self._held({s.id for s in self.slots if s.state == "busy"})

    def _held(self, ids: set[int]) -> int:
        seen: set[int] = set()
        total = 0
        for s in self.slots:
            if s.id not in ids:
                continue
            for g in s.groups:
                if id(g) in seen:
                    continue
                seen.add(id(g))
                ends = [e for k, e in g.ends.items() if k in ids]
                total += max(ends) - g.start
        return total

    def freed_by_clearing(self, slot: Slot) -> int:
        """Cells that emptying `slot` would free (those no other slot holds)."""
        freed = 0
        for g in slot.groups:
            others = [e for k, e in g.ends.items() if k != slot.id]
            freed += g.extent - ((max(others) - g.start) if others else 0)
        return freed

    def best_match(self, prompt: list[int]) -> tuple[Slot | None, int]:
        """The slot holding the longest prefix of `prompt`, and its length."""
        best, n = None, 0
        for s in self.slots:
            if s.tokens:
                k = common_prefix(s.tokens, prompt)
                if k > n:
                    best, n = s, k
        return best, n

    def idle_lru(self) -> list[Slot]:
        return sorted((s for s in self.slots if s.state == "idle"), key=lambda s: s.last_used)

    def touch(self, slot: Slot) -> None:
        self._clock += 1
        slot.last_used = self._clock

    # ---- changes (each mirrored into llama.cpp by the engine) -------------------------

    def truncate(self, slot: Slot, n: int) -> None:
        """Keep positions < n (llama_memory_seq_rm(slot, n, -1))."""
        n = max(0, n)
        while slot.groups:
            g = slot.groups[-1]
            before = g.extent
            if g.start >= n:
                del g.ends[slot.id]
                slot.groups.pop()
                self.used += g.extent - before
                continue
            if g.ends[slot.id] > n:
                g.ends[slot.id] = n
                self.used += g.extent - before
            break
        del slot.tokens[n:]

    def share(self, src: Slot, dst: Slot, n: int) -> None:
        """dst (emptied first) takes src's cells for positions < n
        (llama_memory_seq_cp(src, dst, 0, n)). No cell is added."""
        self.truncate(dst, 0)
        for g in src.groups:
            if g.start >= n:
                break
            g.ends[dst.id] = min(g.ends[src.id], n)
            dst.groups.append(g)
        dst.tokens = src.tokens[:n]

    def extend(self, slot: Slot, tokens: list[int]) -> None:
        """New cells for `tokens` at the slot's next positions (a llama_decode)."""
        k = len(tokens)
        if k == 0:
            return
        if k > self.free:
            raise RuntimeError(f"pool over-committed: {k} cells asked, {self.free} free")
        pos = len(slot.tokens)
        last = slot.groups[-1] if slot.groups else None
        if last is not None and last.ends[slot.id] == pos and last.start + last.extent == pos:
            last.ends[slot.id] = pos + k  # the slot's own tail: grow its group
        else:
            g = Group(pos, {slot.id: pos + k})
            slot.groups.append(g)
        self.used += k
        slot.tokens.extend(tokens)

    def check(self) -> None:
        """The invariants (tests): used equals the cells the groups occupy, each slot's
        groups cover exactly its positions, nothing exceeds the capacity."""
        groups: dict[int, Group] = {}
        for s in self.slots:
            pos = 0
            for g in s.groups:
                assert g.start == pos, (s.id, g.start, pos)
                pos = g.ends[s.id]
                assert pos > g.start
                groups[id(g)] = g
            assert pos == len(s.tokens), (s.id, pos, len(s.tokens))
            assert s.state != "free" or not s.tokens, s.id
        occupied = sum(g.extent for g in groups.values())
        assert occupied == self.used, (occupied, self.used)
        assert 0 <= self.used <= self.capacity
