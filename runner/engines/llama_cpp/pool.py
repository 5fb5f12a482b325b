"""The KV pool's bookkeeping: how many llama.cpp cells each sequence slot holds.

Each slot is one llama.cpp sequence with a KV stream of its own (`kv_unified=False`): its
attention reads its own cells only, which on a CPU is 3x faster than one unified cache at
10 agents of 2K tokens (docs/engines.md). A slot's cells are its positions 0..n-1, so a
slot is its token list. Sharing a prefix between slots copies the source stream
(`llama_memory_seq_cp`, then `llama_memory_seq_rm` past the prefix): the copy holds cells
of its own, as many as the prefix.

`capacity` is the pool's limit in cells, at most slots x cells per slot (the memory
llama.cpp allocated); the engine evicts and preempts to stay within it, so a pool smaller
than the allocation behaves as a smaller memory would. This module keeps the books in
Python, without llama.cpp, so that the engine knows before each step how many cells are
free, how many the running requests hold and what evicting a slot frees.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Slot:
    """One llama.cpp sequence id (and its stream). state: "free" (no cells), "idle" (cells
    kept for `owner`'s next turn, evictable), "busy" (leased to a running request)."""

    id: int
    tokens: list[int] = field(default_factory=list)  # its positions 0..n-1
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


def runs(ids: list[int]) -> int:
    """How many runs of consecutive ids a sorted list has: llama.cpp decodes each run of
    consecutive sequence ids in a ubatch of its own when the streams are separate."""
    return sum(1 for i, s in enumerate(ids) if i == 0 or s != ids[i - 1] + 1)


class Pool:
    def __init__(self, capacity: int, n_slots: int, slot_cells: int) -> None:
        if capacity < 1 or n_slots < 1 or slot_cells < 1:
            raise ValueError(f"a pool needs cells and slots (got {capacity}, {n_slots})")
        if capacity > n_slots * slot_cells:
            raise ValueError(
                f"a pool of {capacity} cells exceeds its {n_slots} slots x {slot_cells} cells"
            )
        self.capacity = capacity
        self.slot_cells = slot_cells
        self.slots = [Slot(i) for i in range(n_slots)]
        self.used = 0
        self._clock = 0

    # ---- queries ----------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def held_by_busy(self) -> int:
        """Cells held by busy slots: SGLang's token_usage numerator."""
        return sum(len(s.tokens) for s in self.slots if s.state == "busy")

    def freed_by_clearing(self, slot: Slot) -> int:
        return len(slot.tokens)

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
        if n < len(slot.tokens):
            self.used -= len(slot.tokens) - n
            del slot.tokens[n:]

    def copy(self, src: Slot, dst: Slot, n: int) -> None:
        """dst (emptied first) takes a copy of src's positions < n
        (llama_memory_seq_cp(src, dst), then llama_memory_seq_rm(dst, n, -1))."""
        self.truncate(dst, 0)
        n = min(n, len(src.tokens))
        if n > self.free:
            raise RuntimeError(f"pool over-committed: {n} cells asked, {self.free} free")
        dst.tokens = src.tokens[:n]
        self.used += n

    def extend(self, slot: Slot, tokens: list[int]) -> None:
        """New cells for `tokens` at the slot's next positions (a llama_decode)."""
        k = len(tokens)
        if k > self.free:
            raise RuntimeError(f"pool over-committed: {k} cells asked, {self.free} free")
        if len(slot.tokens) + k > self.slot_cells:
            raise RuntimeError(
                f"slot {slot.id} over-filled: {len(slot.tokens) + k} of {self.slot_cells} cells"
            )
        self.used += k
        slot.tokens.extend(tokens)

    def check(self) -> None:
        """The invariants (tests): used equals what the slots hold, nothing exceeds the
        capacity or a slot's stream, a free slot holds nothing."""
        assert self.used == sum(len(s.tokens) for s in self.slots), self.used
        assert 0 <= self.used <= self.capacity
        for s in self.slots:
            assert len(s.tokens) <= self.slot_cells, s.id
            assert s.state != "free" or not s.tokens, s.id
