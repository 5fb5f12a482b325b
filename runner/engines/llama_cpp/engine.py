"""The embedded CPU engine: continuous batching on llama.cpp, one context, one finite KV pool.

One worker thread owns the llama.cpp context. Every engine step is one `llama_decode` that
carries the next token of every running request plus a bounded chunk of prompt tokens of
new or resumed requests (the step's token budget, like SGLang's chunked prefill). Requests
are asyncio futures; the event loop never blocks.

Each of the `max_seqs` sequence slots has a KV stream of its own (`kv_unified=False`) and
attention runs without llama.cpp's flash-attention kernel: measured on 2 cores at 10
sequences of 2K tokens, 85 tok/s against 28 for one unified cache with flash attention,
whose CPU kernel visits every cell of every sequence (docs/engines.md). llama.cpp decodes
each run of consecutive sequence ids in a ubatch of its own, so slots are handed out next
to the running ones. The pool of `pool_tokens` cells (pool.py keeps its books) is the
limit the engine holds to. An agent's cells stay in its slot between turns (idle,
evictable), so a new turn prefills only its delta; a prefix held by another slot (the
system prompt, the task text of --samples copies) is copied from that slot's stream
(`llama_memory_seq_cp`), not recomputed. When a step does not fit, idle slots are evicted
least recently used first, then running requests are preempted (fewest generated tokens
first, as SGLang retracts): their cells are dropped and recomputed when they resume. Only a
single request larger than the pool fails (ContextLimitExceeded).

Signals with SGLang's meanings: usage = cells held by running requests / pool (idle
evictable cells excluded; physical occupancy in `extra`), or the share of slots they hold
where that is larger (slots are memory too here: a stream each); cached_tokens on every
generation; evictions, preemptions and recomputed tokens counted (stats()).

Sampling per request is llama.cpp's own sampler chain, built as llama-cpp-python's
`Llama.generate` builds it (penalties, then greedy, or top-k, typical, top-p, min-p,
temperature and a seeded draw). The tool-call grammar is checked lazily, as llama.cpp's
own `common_sampler` does: the chain samples from the free logits, the grammar checks that
one token, and only a rejected token is sampled again over the grammar's valid tokens, the
same as with the grammar over the whole vocabulary (greedy: the same token as grammar-first;
a draw: the same distribution). The valid tokens after a given accepted text are kept, so
the forced text of a call (its `<tool_call>{"name": "` opening, which every agent writes
every turn) costs one read of them per position, not one per request.
Log-probabilities are the raw logits' log-softmax at the row that produced each token
(before penalties, grammar and temperature), as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import difflib
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...chat import toolcall
from ..protocol import CacheStats, ContextLimitExceeded, EngineError, Generation, SamplingParams
from . import native
from .batch import NativeBatch
from .pool import Pool, Slot, common_prefix, runs
from .tokenizer import LlamaTokenizer

# --sampling-arg keys and their kinds (the rest of Llama.generate's sampler options)
SAMPLING_EXTRAS: dict[str, type] = {
    "top_k": int, "min_p": float, "typical_p": float, "repeat_penalty": float,
    "frequency_penalty": float, "presence_penalty": float, "penalty_last_n": int,
}  # fmt: skip
# SGLang's new-token ratio: the share of each request's remaining max_new_tokens kept free
# for it when admitting new requests; decays per step, back to the start after a preemption
RATIO_START, RATIO_MIN, RATIO_DECAY = 0.7, 0.1, 0.001
CLIP_MAX_NEW = 4096
# a grammar redraw looks at the highest logits first (_redraw)
TOP_GRAMMAR = 256
# valid-token masks kept for grammar states seen before (_redraw), 48 KB each for SmolLM2
GRAMMAR_MASKS = 256
# a waiting request whose prompt shares this many more tokens with one still prefilling waits
# for it, then shares its cells
SHARE_WAIT = 32


def _penalized(options: dict[str, Any]) -> bool:
    """Whether the sampler options ask for penalties (the chain then keeps a history)."""
    return bool(
        options["repeat_penalty"] != 1.0
        or options["frequency_penalty"]
        or options["presence_penalty"]
    )


def kv_bytes_per_token(model: Any) -> int:
    """K and V, f16, every layer: 2 * 2 bytes * n_layer * n_head_kv * head_dim."""
    import llama_cpp

    n_layer = llama_cpp.llama_model_n_layer(model)
    head_dim = llama_cpp.llama_model_n_embd(model) // max(1, llama_cpp.llama_model_n_head(model))
    return 4 * n_layer * llama_cpp.llama_model_n_head_kv(model) * head_dim


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 8 << 30


def default_max_seqs(slot_bytes: int, cap: int = 16) -> int:
    """As many slots as a quarter of the memory available now holds, 1..`cap` (each slot
    allocates a whole stream; past ~16 sequences a 2-core CPU gains little, see
    docs/engines.md)."""
    return max(1, min(cap, _available_memory() // 4 // max(1, slot_bytes)))


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    sp: SamplingParams
    agent: str | None
    fut: asyncio.Future[Generation]
    loop: asyncio.AbstractEventLoop
    max_new: int
    t0: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: Slot | None = None
    done_prompt: int = 0  # tokens of prompt + out[:-1] in the slot's cells
    cached: int | None = None  # prefix found in the pool at first admission
    sampler: Any = None  # the chain: penalties, then greedy or the seeded draw
    grammar: Any = None  # the tool-call grammar, checked lazily (_sample)
    # valid tokens among the highest logits that make a grammar redraw exact (_redraw)
    enough: int | None = None
    cancelled: bool = False
    text: bytes = b""
    said: bytes = b""  # the bytes the grammar accepted: its state is a function of them

    def context(self) -> list[int]:
        """What the slot must hold before the next sampled token: the prompt, then every
        generated token but the last (not yet decoded)."""
        return self.prompt + self.out[:-1] if self.out else self.prompt


class LlamaCppEngine:
    """Implements Engine, ConstrainedDecoding, TokenLogprobs, SamplingCheck and EngineStats
    (runner/engines/protocol.py)."""

    name = "llama.cpp"

    def __init__(
        self,
        model_path: str | Path | None = None,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        pool_tokens: int | None = None,
        max_seqs: int | None = None,
        prefill_chunk: int = 512,
        seed: int = 0,
        sampling_extra: dict[str, Any] | None = None,
    ) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise EngineError(
                "the CPU engine needs llama-cpp-python: pip install "
                f"llama-cpp-python=={native.PINNED_VERSION} (compiles llama.cpp, ~5 min) ({e})"
            ) from None
        limit = llama_cpp.llama_max_parallel_sequences()
        if max_seqs is not None and not 1 <= max_seqs <= limit:
            raise ValueError(f"--max-seqs must be 1..{limit}, got {max_seqs}")
        if prefill_chunk < 16:
            raise ValueError(f"--prefill-chunk must be >= 16 tokens, got {prefill_chunk}")
        if pool_tokens is not None and pool_tokens < 64:
            raise ValueError(f"--pool-tokens must be >= 64, got {pool_tokens}")
        self._lc = llama_cpp
        path = Path(model_path) if model_path else native.default_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model, self.model_path = path.name, str(path)
        self.threads = n_threads or max(1, os.cpu_count() or 1)
        self.load = native.load_choice(native.system_info(), native.cpu_flags())
        self._model = native.load_model(path, self.load)
        self.bytes_per_token = kv_bytes_per_token(self._model)
        n_train = llama_cpp.llama_model_n_ctx_train(self._model)
        # every slot's stream holds a whole context; llama.cpp pads it to 256 cells
        slot_cells = -(-min(n_ctx, n_train or n_ctx) // 256) * 256
        if max_seqs is None:
            max_seqs = default_max_seqs(slot_cells * self.bytes_per_token)
        cells = pool_tokens or slot_cells * max_seqs
        if cells > slot_cells * max_seqs:
            raise ValueError(
                f"--pool-tokens {cells} exceeds the {slot_cells * max_seqs} cells that "
                f"{max_seqs} sequences of {slot_cells} tokens allocate: raise --max-seqs"
            )
        self.max_seqs, self.chunk = max_seqs, prefill_chunk
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = slot_cells * max_seqs
        cp.n_batch = prefill_chunk + max_seqs
        cp.n_ubatch = min(cp.n_batch, 512)
        cp.n_seq_max = max_seqs
        cp.kv_unified = False  # a stream per sequence: attention reads its own cells only
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # 3x slower on CPU
        cp.n_threads = cp.n_threads_batch = self.threads
        self._ctx = llama_cpp.llama_init_from_model(self._model, cp)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise EngineError(
                f"llama.cpp could not create a context of {max_seqs} x {slot_cells} cells"
            )
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        slot_cells = llama_cpp.llama_n_ctx_seq(self._ctx)
        self.pool = Pool(min(cells, slot_cells * max_seqs), max_seqs, slot_cells)
        self.context_limit = min(n_ctx, slot_cells, self.pool.capacity, n_train or n_ctx)
        self.pool_bytes = self.pool.capacity * self.bytes_per_token
        self.kv_bytes = slot_cells * max_seqs * self.bytes_per_token  # what was allocated
        self._batch = NativeBatch(cp.n_batch)
        self._tok = LlamaTokenizer(self._model, self.model_path)
        self._n_vocab = self._tok.n_vocab
        self._grammars: dict[str, bytes] = {}
        self._sampling_extra = dict(sampling_extra or {})
        self._seed = seed
        import numpy as np  # a dependency of llama-cpp-python

        self._np = np
        self._ids = np.arange(self._n_vocab, dtype=np.int32)
        self._cand = np.zeros(self._n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._cand_p = self._cand.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
        self._one = (llama_cpp.llama_token_data * 1)()
        # (schema, accepted bytes) -> the grammar's valid tokens there, least recently used first
        self._masks: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
        self._lead: Any = None  # each token's first byte, read at the first grammar pass
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._done: list[tuple[asyncio.AbstractEventLoop, Any]] = []  # results to deliver
        self._seen: dict[str, list[int]] = {}  # agent -> the context it last held
        self._ratio = RATIO_START
        self._stats: dict[str, Any] = dict.fromkeys(
            ("steps", "ubatches", "decode_tokens", "prefill_tokens", "cached_tokens",
             "copied_tokens", "recomputed_tokens", "evictions", "evicted_cells", "preemptions",
             "requests", "grammar_resamples", "grammar_passes", "busy_seconds"), 0,
        )  # fmt: skip
        self._snapshot = self._read_cache()
        self._closing = threading.Event()
        self._worker = threading.Thread(target=self._loop, name="llama", daemon=True)
        self._worker.start()

    # ---- the protocol -----------------------------------------------------------------

    @property
    def tokenizer(self) -> LlamaTokenizer:
        return self._tok

    @property
    def constrain_by_default(self) -> bool:
        return True  # a small model rarely writes a well-formed call without the grammar

    @property
    def gives_logprobs(self) -> bool:
        return True

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, agent: str | None = None
    ) -> Generation:
        if self._closing.is_set():
            raise EngineError("engine is shut down")
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise EngineError("empty prompt")
        room = self.context_limit - len(prompt)
        if room < 2:
            raise ContextLimitExceeded(
                f"prompt of {len(prompt)} tokens leaves no room in the {self.context_limit}-token"
                f" context (pool {self.pool.capacity} cells)"
            )
        loop = asyncio.get_running_loop()
        req = _Request(prompt, sampling, agent, loop.create_future(), loop,
                       max_new=min(sampling.max_new_tokens, room - 1))  # fmt: skip
        self._inbox.put(("generate", req))
        try:
            return await asyncio.shield(req.fut)
        except asyncio.CancelledError:
            req.cancelled = True  # the worker frees its cells at its next step
            self._inbox.put(("wake", None))
            raise

    async def end_agent(self, agent: str) -> None:
        self._inbox.put(("end", agent))

    def check_sampling(self, sampling: SamplingParams) -> None:
        for key, value in self._sampling_extra.items():
            kind = SAMPLING_EXTRAS.get(key)
            if kind is None:
                close = difflib.get_close_matches(key, list(SAMPLING_EXTRAS), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(
                    f"--sampling-arg {key}: not a sampling parameter of the llama.cpp engine"
                    f"{hint}; it takes {', '.join(SAMPLING_EXTRAS)}"
                )
            ok = (
                isinstance(value, int) and not isinstance(value, bool)
                if kind is int
                else isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            if not ok:
                raise ValueError(
                    f"--sampling-arg {key}={value!r}: llama.cpp takes "
                    f"{'an int' if kind is int else 'a float'} here"
                )

    def cache_stats(self) -> CacheStats:
        return self._snapshot

    def stats(self) -> dict[str, Any]:
        return {
            **self._stats,
            "busy_seconds": round(self._stats["busy_seconds"], 3),
            "pool_tokens": self.pool.capacity,
            "pool_bytes": self.pool_bytes,
            "kv_bytes": self.kv_bytes,
            "slot_tokens": self.pool.slot_cells,
            "max_seqs": self.max_seqs,
            "prefill_chunk": self.chunk,
            "threads": self.threads,
            "load": self.load.why,
        }

    async def aclose(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._inbox.put(("wake", None))
        await asyncio.get_running_loop().run_in_executor(None, self._worker.join)
        self._tok.closed = True  # a freed llama.cpp model segfaults: raise instead
        self._batch.close()
        self._lc.llama_free(self._ctx)
        self._lc.llama_model_free(self._model)

    # ---- the worker thread --------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing.is_set():
            idle = not self._waiting and not self._running
            try:
                msg = self._inbox.get(timeout=0.5) if idle else self._inbox.get_nowait()
            except queue.Empty:
                msg = None
            while msg is not None:
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            stepped = bool(self._waiting or self._running)
            if stepped:
                t0 = time.perf_counter()
                try:
                    self._step()
                except Exception as e:  # a native failure fails the requests, not the batch
                    self._fail_all(EngineError(f"llama.cpp step failed: {type(e).__name__}: {e}"))
                self._stats["busy_seconds"] += time.perf_counter() - t0
            if stepped or self._done:
                self._snapshot = self._read_cache()
            self._deliver()
        self._fail_all(EngineError("engine shut down during generation"))
        self._deliver()

    def _deliver(self) -> None:
        """Hand the finished requests' results to their event loops, after the signals are
        read again: a caller that awaited a generation sees the pool without it."""
        done, self._done = self._done, []
        for loop, deliver in done:
            loop.call_soon_threadsafe(deliver)

    def _handle(self, msg: tuple[str, Any]) -> None:
        kind, what = msg
        if kind == "generate":
            self._waiting.append(what)
        elif kind == "end":
            for s in self.pool.slots:
                if s.state == "idle" and s.owner == what:
                    self._clear(s)
            self._seen.pop(what, None)

    def _clear(self, slot: Slot) -> None:
        self.pool.truncate(slot, 0)
        self._lc.llama_memory_seq_rm(self._mem, slot.id, -1, -1)
        slot.state, slot.owner = "free", None

    def _truncate(self, slot: Slot, n: int) -> None:
        if n < len(slot.tokens):
            self.pool.truncate(slot, n)
            self._lc.llama_memory_seq_rm(self._mem, slot.id, n, -1)

    def _finish(self, r: _Request, result: Generation | BaseException) -> None:
        for smpl in (r.sampler, r.grammar):
            if smpl is not None:
                self._lc.llama_sampler_free(smpl)
        r.sampler = r.grammar = None
        if r.slot is not None:
            if isinstance(result, BaseException) or r.cancelled:
                self._clear(r.slot)  # a failed or cancelled request frees its cells at once
            else:
                r.slot.state = "idle"
                self.pool.touch(r.slot)
                if r.agent:  # a copy: eviction truncates the slot's list in place
                    self._seen[r.agent] = list(r.slot.tokens)
            r.slot = None

        def deliver() -> None:
            if r.fut.done():
                return
            if isinstance(result, BaseException):
                r.fut.set_exception(result)
            else:
                r.fut.set_result(result)

        if not r.cancelled:
            self._done.append((r.loop, deliver))

    def _fail_all(self, err: EngineError) -> None:
        for r in [*self._running, *self._waiting]:
            self._finish(r, err)
        self._running, self._waiting = [], []

    # ---- one step -------------------------------------------------------------------------

    def _step(self) -> None:
        for r in [r for r in [*self._running, *self._waiting] if r.cancelled]:
            (self._running if r in self._running else self._waiting).remove(r)
            self._finish(r, EngineError("cancelled"))
        decoding = [r for r in self._running if r.out and r.done_prompt == len(r.context())]
        # 1. room for one token of every decoding request: evict idle, then preempt
        while len(decoding) > self.pool.free and self._make_room(len(decoding)):
            decoding = [r for r in self._running if r.out and r.done_prompt == len(r.context())]
        # 2. new requests, before this step's tokens enter the books: a prefix copied from
        # another slot must be one llama.cpp has computed (copies run before the decode)
        self._admit(hold=len(decoding))
        # (slot, position, token, request wanting this row's logits)
        rows: list[tuple[int, int, int, _Request | None]] = []
        for r in decoding:
            assert r.slot is not None
            rows.append((r.slot.id, len(r.slot.tokens), r.out[-1], r))
            self.pool.extend(r.slot, [r.out[-1]])
            r.done_prompt += 1
        # 3. prompt chunks: the prefilling requests in arrival order, up to the budget
        budget = self.chunk
        for r in self._running:
            ctx = r.context()
            if r in decoding or r.done_prompt >= len(ctx) or budget <= 0:
                continue
            assert r.slot is not None
            n = min(len(ctx) - r.done_prompt, budget, self.pool.free)
            if n <= 0:
                continue
            part = ctx[r.done_prompt : r.done_prompt + n]
            last = r.done_prompt + n == len(ctx)
            for i, t in enumerate(part):
                rows.append((r.slot.id, r.done_prompt + i, t, r if last and i == n - 1 else None))
            self.pool.extend(r.slot, part)
            r.done_prompt += n
            budget -= n
            self._stats["prefill_tokens"] += n
        if not rows:
            # nothing could move (the pool is full of prompts in progress): make room, or
            # fail the newest request rather than spin
            if not self._make_room(1) and self._running:
                r = self._running.pop()
                self._finish(
                    r,
                    ContextLimitExceeded(
                        f"the {self.pool.capacity}-token KV pool cannot hold this request"
                    ),
                )
            return
        # by sequence id: llama.cpp splits the batch into runs of consecutive ids
        rows.sort(key=lambda e: (e[0], e[1]))
        self._batch.fill([(t, pos, sid, r is not None) for sid, pos, t, r in rows])
        rc = self._lc.llama_decode(self._ctx, self._batch.struct)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({len(rows)} tokens, "
                               f"{self.pool.free} cells free by the books)")  # fmt: skip
        self._stats["steps"] += 1
        self._stats["ubatches"] += runs(sorted({e[0] for e in rows}))
        self._stats["decode_tokens"] += len(decoding)
        self._ratio = max(RATIO_MIN, self._ratio - RATIO_DECAY)
        for i, (_, _, _, want) in enumerate(rows):
            if want is not None:
                self._sample(want, i)

    def _make_room(self, need: int) -> bool:
        """Free cells until `need` fit: evict the least recently used idle slot, else preempt
        the running request with the fewest generated tokens. False if nothing can go."""
        idle = self.pool.idle_lru()
        if idle:
            self._evict(idle[0])
            return True
        if len(self._running) <= 1:
            return False
        victim = min(self._running, key=lambda r: (len(r.out), -len(r.prompt)))
        self._preempt(victim)
        return True

    def _evict(self, slot: Slot) -> None:
        self._stats["evictions"] += 1
        self._stats["evicted_cells"] += self.pool.freed_by_clearing(slot)
        self._clear(slot)

    def _preempt(self, r: _Request) -> None:
        assert r.slot is not None
        self._stats["preemptions"] += 1
        self._running.remove(r)
        self._clear(r.slot)
        r.slot, r.done_prompt = None, 0
        self._waiting.insert(0, r)
        self._ratio = RATIO_START

    def _reserve(self, r: _Request) -> int:
        return int(min(max(r.max_new - len(r.out), 0), CLIP_MAX_NEW) * self._ratio)

    def _admit(self, hold: int) -> None:
        """Waiting requests in arrival order, while a slot and the cells they need (prompt
        plus the reserve of every running request) can be had. `hold`: cells this step's
        decoding tokens will take."""
        i = 0
        while i < len(self._waiting):
            r = self._waiting[i]
            ctx = r.context()
            if len(ctx) + 1 > self.pool.capacity:
                self._waiting.pop(i)
                self._finish(r, ContextLimitExceeded(
                    f"a request of {len(ctx)} tokens cannot fit the {self.pool.capacity}-token "
                    "KV pool (raise --pool-tokens)"))  # fmt: skip
                continue
            src, n = self.pool.best_match(ctx)
            if self._coming(ctx, n):
                i += 1  # a running prompt will hold more of it soon: copy that instead
                continue
            slot = self._slot_for(r)
            if slot is None:
                return
            src, n = self.pool.best_match(ctx)
            own = common_prefix(slot.tokens, ctx) if slot.tokens else 0
            copy = src is not None and src is not slot and n > own
            reuse = min(n if copy else own, len(ctx) - 1)
            keep = 0 if copy else reuse  # cells the slot keeps
            need = len(ctx) - keep + self._reserve(r) + hold
            need += sum(self._reserve(x) for x in self._running)
            evictable = sum(self.pool.freed_by_clearing(s) for s in self.pool.idle_lru()
                            if s is not slot and s is not src)  # fmt: skip
            have = self.pool.free + len(slot.tokens) - keep + evictable
            if self._running and need > have:
                return  # it waits: running requests keep their room
            self._waiting.pop(i)
            slot.state, slot.owner = "busy", r.agent
            self.pool.touch(slot)
            if copy:
                assert src is not None
                self._clear(slot)
                slot.state, slot.owner = "busy", r.agent
                while self.pool.free - hold < reuse and self._evict_other(slot, src):
                    pass
                reuse = max(0, min(reuse, self.pool.free - hold))
                if reuse:
                    self.pool.copy(src, slot, reuse)
                    # the whole stream (llama.cpp copies streams whole), then cut to the prefix
                    self._lc.llama_memory_seq_cp(self._mem, src.id, slot.id, -1, -1)
                    self._lc.llama_memory_seq_rm(self._mem, slot.id, reuse, -1)
                    self._stats["copied_tokens"] += reuse
            else:
                self._truncate(slot, reuse)
            # the cells for the rest come as the chunks are decoded: evict idle slots now
            while self.pool.free - hold < min(len(ctx) - reuse, self.chunk):
                if not self._evict_other(slot, None):
                    break
            r.slot, r.done_prompt = slot, reuse
            if r.cached is None:
                r.cached = reuse
                seen = self._seen.get(r.agent or "")
                if seen:
                    self._stats["recomputed_tokens"] += max(
                        0, min(common_prefix(seen, ctx), len(ctx) - 1) - reuse
                    )
            else:
                self._stats["recomputed_tokens"] += len(ctx) - reuse  # after a preemption
            if r.sampler is None:
                r.sampler, r.grammar = self._sampler(r.sp)
                r.enough = self._enough(r.sp)
            self._running.append(r)

    def _evict_other(self, slot: Slot, src: Slot | None) -> bool:
        for s in self.pool.idle_lru():
            if s is not slot and s is not src:
                self._evict(s)
                return True
        return False

    def _coming(self, ctx: list[int], have: int) -> bool:
        """Whether a request still prefilling will soon hold a longer prefix of `ctx` than
        the pool has now (by SHARE_WAIT tokens or more): waiting a few steps for it beats
        computing the same cells twice (agents that start together share the system prompt)."""
        for r in self._running:
            if (
                r.done_prompt < min(len(r.prompt), have + SHARE_WAIT)
                and common_prefix(r.prompt, ctx) >= have + SHARE_WAIT
            ):
                return True
        return False

    def _slot_for(self, r: _Request) -> Slot | None:
        """The agent's own idle slot, else a free one next to the busy ones (llama.cpp
        decodes each run of consecutive ids as a ubatch of its own), else the least
        recently used idle one (evicted), else none (the request waits)."""
        slots = self.pool.slots
        mine = [s for s in slots if s.state == "idle" and r.agent and s.owner == r.agent]
        if mine:
            return mine[0]

        def busy(i: int) -> int:
            return int(0 <= i < len(slots) and slots[i].state == "busy")

        free = [s for s in slots if s.state == "free"]
        if free:
            return min(free, key=lambda s: (-busy(s.id - 1) - busy(s.id + 1), s.id))
        idle = self.pool.idle_lru()
        if idle:
            self._evict(idle[0])
            return idle[0]
        return None

    # ---- sampling -------------------------------------------------------------------------

    def _sampler(self, sp: SamplingParams) -> tuple[Any, Any]:
        """The request's chain (Llama.generate's order, the grammar taken out) and its
        grammar sampler (None without a schema)."""
        lc = self._lc
        x = self._options(sp)
        grammar = None
        if sp.tool_call_schema:
            grammar = lc.llama_sampler_init_grammar(
                lc.llama_model_get_vocab(self._model), self._grammar(sp.tool_call_schema),
                b"root")  # fmt: skip
            if not grammar:
                raise EngineError("llama.cpp could not compile the tool-call grammar")
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if _penalized(x):
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(
                x["penalty_last_n"], x["repeat_penalty"], x["frequency_penalty"],
                x["presence_penalty"]))  # fmt: skip
        if sp.temperature <= 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        else:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(int(x["top_k"])))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_typical(x["typical_p"], 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sp.top_p, 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(x["min_p"], 1))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sp.temperature))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(sp.seed & 0xFFFFFFFF))
        return chain, grammar

    def _options(self, sp: SamplingParams) -> dict[str, Any]:
        """Llama.generate's sampler options for `sp`: its defaults, then --sampling-arg."""
        return {"top_k": 40 if sp.temperature else 1, "min_p": 0.0, "typical_p": 1.0,
                "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "penalty_last_n": 64, **self._sampling_extra}  # fmt: skip

    def _grammar(self, schema: str) -> bytes:
        """The reply as exactly `<tool_call>{...}</tool_call>` with the object matching the
        schema: llama.cpp's GBNF from the JSON schema, wrapped in the tags."""
        g = self._grammars.get(schema)
        if g is None:
            from llama_cpp.llama_grammar import json_schema_to_gbnf

            gbnf = json_schema_to_gbnf(schema).replace("root ::=", "call ::=", 1)
            gbnf += f'\nroot ::= "{toolcall.OPEN}" call "{toolcall.CLOSE}"\n'
            g = self._grammars[schema] = gbnf.encode()
        return g

    def _enough(self, sp: SamplingParams) -> int | None:
        """How many grammar-valid tokens among the TOP_GRAMMAR highest logits make a redraw
        over them alone the same as over the whole vocabulary: 1 for greedy, top_k for a
        draw (the chain keeps the top_k highest, and every valid token outside that set
        is lower than all inside). None where the chain could lift a lower token (penalties)
        or keeps more (top_k 0 or above TOP_GRAMMAR)."""
        x = self._options(sp)
        if _penalized(x):
            return None
        if sp.temperature <= 0.0:
            return 1
        k = int(x["top_k"])
        return k if 0 < k <= TOP_GRAMMAR else None

    def _candidates(self, logits: Any, ids: Any = None) -> Any:
        """A llama_token_data_array over the engine's buffer: the whole vocabulary in id
        order, or the token ids `ids` in their order."""
        cand = self._cand[: self._n_vocab if ids is None else len(ids)]
        cand["id"] = self._ids if ids is None else ids
        cand["logit"] = logits if ids is None else logits[ids]
        cand["p"] = 0.0
        return self._lc.llama_token_data_array(self._cand_p, len(cand), -1, False)

    def _draw(self, chain: Any, logits: Any) -> int:
        """Apply `chain` to the whole vocabulary; the token drawn."""
        arr = self._candidates(logits)
        self._lc.llama_sampler_apply(chain, ctypes.byref(arr))
        return int(arr.data[arr.selected].id)

    def _redraw(self, r: _Request, logits: Any) -> int:
        """The token drawn with the grammar, the same as the chain over the whole vocabulary
        with the grammar applied first, by the cheapest exact way: the valid tokens kept for
        this grammar state; the TOP_GRAMMAR highest logits when enough of them are valid
        (see _enough); else the grammar's valid set read anew (_valid) and kept. The grammar
        only sets rejected logits to -inf, so a kept mask gives the very array it would. Its
        state is the parse of the bytes it accepted (llama.cpp feeds a token's text to it
        code point by code point, a split UTF-8 sequence carried over), so masks are kept by
        those bytes: two spellings of one text share one."""
        np = self._np
        key = (r.sp.tool_call_schema or "", r.said)
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
        else:
            if r.enough is not None:
                top = np.argpartition(logits, -TOP_GRAMMAR)[-TOP_GRAMMAR:].astype(np.int32)
                top = top[np.lexsort((top, -logits[top]))]  # highest first; ties: the lower id
                arr = self._candidates(logits, top)
                self._lc.llama_sampler_apply(r.grammar, ctypes.byref(arr))
                if int(np.isfinite(self._cand["logit"][:TOP_GRAMMAR]).sum()) >= r.enough:
                    self._lc.llama_sampler_apply(r.sampler, ctypes.byref(arr))
                    return int(arr.data[arr.selected].id)
            mask = self._masks[key] = self._valid(r.grammar)
            if len(self._masks) > GRAMMAR_MASKS:
                self._masks.popitem(last=False)
        arr = self._candidates(logits)
        self._cand["logit"][~mask] = -np.inf
        self._lc.llama_sampler_apply(r.sampler, ctypes.byref(arr))
        return int(arr.data[arr.selected].id)

    def _valid(self, grammar: Any) -> Any:
        """The tokens `grammar` accepts next, as a mask over the vocabulary. A token is valid
        only if a token of its first byte alone is (the grammar accepts a token when some
        parse survives all its bytes, so also its first; a UTF-8 lead byte alone is accepted
        when some character it begins is), so the grammar checks the byte tokens first,
        then only the tokens that begin with an accepted byte: in a call's fixed text a few
        hundred tokens, not the whole vocabulary."""
        np = self._np
        if self._lead is None:
            pieces = [self._tok.piece(t) for t in range(self._n_vocab)]
            # 256: an empty piece, which the grammar always rejects
            self._lead = np.array([q[0] if q else 256 for q in pieces], dtype=np.int16)
            byte_tok: dict[int, int] = {}
            for t, q in enumerate(pieces):
                if len(q) == 1:
                    byte_tok.setdefault(q[0], t)
            self._byte_tok = (np.array(list(byte_tok), dtype=np.int16),
                              np.array(list(byte_tok.values()), dtype=np.int32))  # fmt: skip
            vocab = self._lc.llama_model_get_vocab(self._model)
            self._eog = np.zeros(self._n_vocab, dtype=bool)
            self._eog[[t for t in range(self._n_vocab) if self._lc.llama_vocab_is_eog(
                vocab, t)]] = True  # fmt: skip
            self._zeros = np.zeros(self._n_vocab, dtype=np.float32)
        self._stats["grammar_passes"] += 1
        first, probe = self._byte_tok
        arr = self._candidates(self._zeros, probe)
        self._lc.llama_sampler_apply(grammar, ctypes.byref(arr))
        ok = np.ones(257, dtype=bool)  # a byte with no token of its own: not ruled out
        ok[first] = np.isfinite(self._cand["logit"][: len(probe)])
        ok[256] = False
        maybe = np.flatnonzero(ok[self._lead] | self._eog).astype(np.int32)
        arr = self._candidates(self._zeros, maybe)
        self._lc.llama_sampler_apply(grammar, ctypes.byref(arr))
        mask = np.zeros(self._n_vocab, dtype=bool)
        mask[maybe[np.isfinite(self._cand["logit"][: len(maybe)])]] = True
        return mask

    def _allowed(self, grammar: Any, tok: int) -> bool:
        one = self._one
        one[0] = self._lc.llama_token_data(tok, 0.0, 0.0)
        arr = self._lc.llama_token_data_array(one, 1, -1, False)
        self._lc.llama_sampler_apply(grammar, ctypes.byref(arr))
        return math.isfinite(one[0].logit)

    def _sample(self, r: _Request, row: int) -> None:
        lc = self._lc
        ptr = lc.llama_get_logits_ith(self._ctx, row)
        logits = self._np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        if r.enough is not None:
            # llama.cpp fills the candidates in C and accepts the token into the chain, which
            # without penalties keeps no history: a redraw after it changes nothing there
            tok = int(lc.llama_sampler_sample(r.sampler, self._ctx, row))
            accepted = True
        else:
            tok, accepted = self._draw(r.sampler, logits), False
        if r.grammar is not None:
            if not self._allowed(r.grammar, tok):
                self._stats["grammar_resamples"] += 1
                tok = self._redraw(r, logits)
            lc.llama_sampler_accept(r.grammar, tok)
            r.said += self._tok.piece(tok)
        if not accepted:
            lc.llama_sampler_accept(r.sampler, tok)
        if r.sp.logprobs:
            r.logprobs.append(self._logprob(logits, tok))
        r.out.append(tok)
        finish, eos = None, False
        if tok in self._tok.eos_ids:
            finish, eos = "stop", True
        elif r.sp.stop:
            r.text += self._tok.decode_bytes([tok])
            if any(s in r.text.decode("utf-8", "replace") for s in r.sp.stop):
                finish = "stop"
        if finish is None and len(r.out) >= r.max_new:
            finish = "length"
        if finish is None:
            return
        self._running.remove(r)
        self._stats["requests"] += 1
        self._stats["cached_tokens"] += r.cached or 0
        visible = r.out[:-1] if eos else r.out
        gen = Generation(
            output_ids=list(r.out),
            text=self._tok.decode(visible),
            prompt_tokens=len(r.prompt),
            cached_tokens=r.cached or 0,
            completion_tokens=len(r.out),
            finish_reason=finish,
            seconds=time.perf_counter() - r.t0,
            stopped_on_eos=eos,
            output_logprobs=list(r.logprobs) if r.sp.logprobs else None,
        )
        self._finish(r, gen)

    def _logprob(self, logits: Any, token: int) -> float:
        """log-softmax of the raw logits at `token` (float32 exponentials, float64 sum)."""
        np = self._np
        top = logits.max()
        total = np.exp(logits - top).sum(dtype=np.float64)
        return float(logits[token] - top) - math.log(total)

    # ---- signals --------------------------------------------------------------------------

    def _read_cache(self) -> CacheStats:
        """usage: the larger of the cells and the slots that running requests hold. Each slot
        is a stream of its own, so slots run out before cells when agents outnumber them:
        idle agents' slots are then evicted as their cells would be on a full GPU pool."""
        p = self.pool
        held = p.held_by_busy()
        cells = held / p.capacity
        slots = sum(1 for s in p.slots if s.state == "busy") / len(p.slots)
        return CacheStats(
            usage=max(cells, slots),
            capacity_tokens=p.capacity,
            used_tokens=held,
            resident_limit=len(p.slots),
            shares_prefixes=False,  # a common prefix is copied into each stream
            extra={
                "cell_usage": cells,
                "slot_usage": slots,
                "physical_occupancy": p.used / p.capacity,
                "used_cells": p.used,
                "evictable_cells": p.used - held,
                "free_cells": p.free,
                "running": len(self._running),
                "waiting": len(self._waiting),
                "evictions": self._stats["evictions"],
                "preemptions": self._stats["preemptions"],
                "recomputed_tokens": self._stats["recomputed_tokens"],
            },
        )
