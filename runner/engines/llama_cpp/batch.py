"""A llama_batch of fixed size, filled in place for every engine step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class NativeBatch:
    """llama_batch_init(n_tokens, 0, 1), freed with `close`. Each entry is (token,
    position, sequence id, wants logits): one sequence per token (sharing goes through
    llama_memory_seq_cp, not the batch)."""

    def __init__(self, n_tokens: int) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self.capacity = n_tokens
        self.struct: Any = llama_cpp.llama_batch_init(n_tokens, 0, 1)

    def fill(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        if len(entries) > self.capacity:
            raise ValueError(f"{len(entries)} tokens in a batch of {self.capacity}")
        b = self.struct
        tok, pos, nseq, seq, logits = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        for i, (t, p, s, want) in enumerate(entries):
            tok[i] = t
            pos[i] = p
            nseq[i] = 1
            seq[i][0] = s
            logits[i] = 1 if want else 0
        b.n_tokens = len(entries)

    def close(self) -> None:
        if self.struct is not None:
            self._lc.llama_batch_free(self.struct)
            self.struct = None
