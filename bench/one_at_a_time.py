"""The one-at-a-time CPU engine the batched engine replaced (runner/engines/llama_cpp/ before
commit 8366c1f), kept here only as bench/cpu_engine.py's baseline for part (c). It is not a
runner engine and nothing in runner/ imports it.

llama.cpp's high-level `Llama` holds one live sequence; a bounded cache of saved sequence
states (KV bytes keyed by their token ids, LRU by bytes) lets agents taking turns find
their prefix again; requests run one at a time on one worker thread. As then: flash
attention off (`Llama`'s default), the grammar applied to every token. As now: the model
loads with the same extra-buffer-type choice as the batched engine (`native.load_choice`),
so both run the same kernels.

    python -m bench.one_at_a_time RUN.PY-OPTIONS...   # run.py with this engine as llama.cpp
"""

from __future__ import annotations

import asyncio
import ctypes
import difflib
import inspect
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.chat import toolcall
from runner.chat.template import ChatTemplate
from runner.engines.llama_cpp import native
from runner.engines.llama_cpp.native import default_model_path
from runner.engines.protocol import (
    CacheStats,
    ContextLimitExceeded,
    EngineError,
    Generation,
    SamplingParams,
)

OWNED_GENERATE_KEYS = frozenset(
    {"tokens", "temp", "top_p", "reset", "grammar", "logits_processor", "stopping_criteria"}
)


_CONTEXT_ERRORS = ("exceed context window", "llama_decode returned 1")


def _common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _State:
    tokens: tuple[int, ...]
    data: bytes


class PrefixStateCache:
    """Saved KV states keyed by token ids; LRU eviction by bytes. A state whose tokens are a
    prefix of a newer state's is dominated and dropped (the newer one serves both)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._states: OrderedDict[tuple[int, ...], _State] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.bytes_per_token: float | None = None  # measured from the first saved state

    def best(self, prompt: list[int]) -> tuple[_State | None, int]:
        best, best_len = None, 0
        for st in self._states.values():
            n = _common_prefix(st.tokens, prompt)
            if n > best_len:
                best, best_len = st, n
        if best is not None:
            self._states.move_to_end(best.tokens)
        return best, best_len

    def put(self, tokens: tuple[int, ...], data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            return
        for k in [k for k in self._states if tokens[: len(k)] == k]:
            self.bytes -= len(self._states.pop(k).data)
        self._states[tokens] = _State(tokens, data)
        self.bytes += len(data)
        if self.bytes_per_token is None and len(tokens) >= 64:
            self.bytes_per_token = len(data) / len(tokens)
        while self.bytes > self.capacity_bytes and self._states:
            _, st = self._states.popitem(last=False)
            self.bytes -= len(st.data)
            self.evictions += 1

    @property
    def tokens(self) -> int:
        return sum(len(k) for k in self._states)

    def clear(self) -> None:
        self._states.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._states)


class LlamaCppEngine:
    """Implements Engine, ConstrainedDecoding, TokenLogprobs and SamplingCheck
    (runner/engines/protocol.py). `sampling_extra`: more Llama.generate keywords for every request
    (e.g. top_k, min_p, repeat_penalty, overriding the engine's own defaults)."""

    name = "llama.cpp"

    def __init__(
        self,
        model_path: str | Path | None = None,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        cache_bytes: int = 1 << 30,
        seed: int = 0,
        sampling_extra: dict[str, Any] | None = None,
    ) -> None:
        try:
            import llama_cpp
        except ImportError as e:
            raise EngineError(
                "the CPU engine needs llama-cpp-python: pip install llama-cpp-python "
                f"(compiles llama.cpp, ~5 min on 2 cores) ({e})"
            ) from None
        self._lc = llama_cpp
        path = Path(model_path) if model_path else default_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model = path.name
        self.model_path = str(path)
        choice = native.load_choice(native.system_info(), native.cpu_flags())
        import llama_cpp.llama_cpp as bindings  # what Llama() calls

        defaults = bindings.llama_model_default_params

        def model_params() -> Any:  # Llama() takes no use_extra_bufts: set it on its defaults
            p = defaults()
            p.use_extra_bufts = choice.use_extra_bufts
            return p

        bindings.llama_model_default_params = model_params
        try:
            self._llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=n_threads or max(1, os.cpu_count() or 1),
                n_batch=512,
                seed=seed,
                verbose=False,
            )
        finally:
            bindings.llama_model_default_params = defaults
        self.context_limit = self._llm.n_ctx()
        self._tok = LlamaTokenizer(self._llm)
        self.cache = PrefixStateCache(cache_bytes)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        self._grammars: dict[str, Any] = {}  # tool-call schema -> compiled GBNF grammar
        self._closing = threading.Event()
        self._sampling_extra = dict(sampling_extra or {})

    @property
    def tokenizer(self) -> LlamaTokenizer:
        return self._tok

    @property
    def constrain_by_default(self) -> bool:
        # SamplingParams.tool_call_schema becomes a GBNF grammar (see _grammar); on by default
        # because a small model rarely writes a well-formed call without it.
        return True

    @property
    def gives_logprobs(self) -> bool:
        return True

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, agent: str | None = None
    ) -> Generation:
        if self._closing.is_set():
            raise EngineError("engine is shut down")
        loop = asyncio.get_running_loop()
        # The worker thread is the only place the llama context is touched.
        return await loop.run_in_executor(
            self._pool, self._generate_sync, list(input_ids), sampling
        )

    async def end_agent(self, agent: str) -> None:
        return None  # the prefix cache is shared; LRU ages an ended agent's states out

    def check_sampling(self, sampling: SamplingParams) -> None:
        """The extras (--sampling-arg) against `Llama.generate`'s keywords, the call each
        request makes: a known name, of its default's type (a float, an int, a bool);
        ValueError naming the option. llama.cpp's sampler checks no ranges itself."""
        params = inspect.signature(self._llm.generate).parameters
        allowed = sorted(set(params) - OWNED_GENERATE_KEYS)
        for key, value in self._sampling_extra.items():
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(
                    f"--sampling-arg {key}: not a sampling parameter of llama.cpp's "
                    f"Llama.generate{hint}; it takes {', '.join(allowed)}"
                )
            default = params[key].default
            if not _same_kind(value, default):
                kind = {bool: "a bool", int: "an int", float: "a float"}.get(type(default))
                raise ValueError(
                    f"--sampling-arg {key}={value!r}: llama.cpp takes {kind or 'no such value'} "
                    f"here (default {default!r})"
                )

    def cache_stats(self) -> CacheStats:
        c = self.cache
        return CacheStats(
            usage=c.bytes / c.capacity_bytes if c.capacity_bytes else None,
            capacity_tokens=(
                int(c.capacity_bytes / c.bytes_per_token) if c.bytes_per_token else None
            ),
            used_tokens=c.tokens,
            extra={
                "states": len(c),
                "bytes": c.bytes,
                "capacity_bytes": c.capacity_bytes,
                "evictions": c.evictions,
            },
        )

    async def aclose(self) -> None:
        self._closing.set()
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        self._tok.closed = True  # using a closed llama.cpp model segfaults: raise instead
        self._llm.close()

    # ---- worker thread ---------------------------------------------------------------

    def _generate_sync(self, prompt: list[int], sp: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        llm = self._llm
        if not prompt:
            raise EngineError("empty prompt")
        room = self.context_limit - len(prompt)
        if room < 2:
            raise ContextLimitExceeded(
                f"prompt of {len(prompt)} tokens leaves no room in the {self.context_limit}-token"
                " context"
            )
        max_new = min(sp.max_new_tokens, room - 1)
        # Where is the longest reusable prefix: the live sequence, or a saved state?
        live = _common_prefix(tuple(llm.input_ids[: llm.n_tokens].tolist()), prompt)
        saved, saved_len = self.cache.best(prompt)
        # Like SGLang, at least the last prompt token is recomputed (its logits are needed).
        if saved is not None and saved_len > live:
            live = self._restore(saved, min(saved_len, len(prompt) - 1))
        cached = min(live, len(prompt) - 1)
        llm.set_seed(sp.seed)
        grammar = self._grammar(sp.tool_call_schema) if sp.tool_call_schema else None
        eos = self._tok.eos_ids
        out: list[int] = []
        logprobs: list[float] | None = [] if sp.logprobs else None
        finish = "length"
        stopped_on_eos = False
        text = ""
        options: dict[str, Any] = {
            "top_k": 40 if sp.temperature else 1,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            **self._sampling_extra,
        }
        try:
            for tok in llm.generate(
                prompt, temp=sp.temperature, top_p=sp.top_p, reset=True, grammar=grammar, **options
            ):
                if self._closing.is_set():
                    raise EngineError("engine shut down during generation")
                if logprobs is not None:
                    logprobs.append(self._logprob(tok))
                if tok in eos:
                    out.append(tok)
                    finish, stopped_on_eos = "stop", True
                    break
                out.append(tok)
                if sp.stop:
                    text = self._tok.decode(out)
                    if any(s in text for s in sp.stop):
                        finish = "stop"
                        break
                if len(out) >= max_new:
                    break
        except EngineError:
            raise
        except Exception as e:  # a llama.cpp failure must fail this request only
            llm.reset()
            if any(s in str(e) for s in _CONTEXT_ERRORS):
                raise ContextLimitExceeded(f"llama.cpp: the context is full ({e})") from e
            # in process, nothing passes by itself: no failure here is transient
            raise EngineError(f"llama.cpp generation failed: {type(e).__name__}: {e}") from e
        self._save()
        visible = out[:-1] if stopped_on_eos else out
        return Generation(
            output_ids=out,
            text=self._tok.decode(visible),
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            completion_tokens=len(out),
            finish_reason=finish,
            seconds=time.perf_counter() - t0,
            stopped_on_eos=stopped_on_eos,
            output_logprobs=logprobs,
        )

    def _logprob(self, token: int) -> float:
        """Log-probability of `token` under the raw logits it was sampled from. Llama.generate
        yields each token before it evaluates it, so the context's last logits row (index -1)
        is still the one the sampler used."""
        import numpy as np  # a dependency of llama-cpp-python

        ptr = self._lc.llama_get_logits_ith(self._llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self._llm.n_vocab(),)).astype(np.float64)
        top = logits.max()
        return float(logits[token] - top - np.log(np.exp(logits - top).sum()))

    def _grammar(self, schema: str) -> Any:
        """The reply as exactly `<tool_call>{...}</tool_call>` with the object matching the
        schema: llama.cpp's GBNF grammar from the JSON schema, wrapped in the tags."""
        g = self._grammars.get(schema)
        if g is None:
            from llama_cpp.llama_grammar import LlamaGrammar, json_schema_to_gbnf

            gbnf = json_schema_to_gbnf(schema).replace("root ::=", "call ::=", 1)
            gbnf += f'\nroot ::= "{toolcall.OPEN}" call "{toolcall.CLOSE}"\n'
            g = self._grammars[schema] = LlamaGrammar.from_string(gbnf, verbose=False)
        return g

    def _save(self) -> None:
        llm, lc = self._llm, self._lc
        n = llm.n_tokens
        if n <= 0:
            return
        size = lc.llama_state_seq_get_size(llm.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        got = lc.llama_state_seq_get_data(llm.ctx, buf, size, 0)
        if got:
            self.cache.put(tuple(llm.input_ids[:n].tolist()), bytes(buf)[:got])

    def _restore(self, st: _State, keep: int) -> int:
        """Load a saved state into the live sequence and keep its first `keep` tokens (fewer
        than the prompt's). The rest is cut from the KV, so the live sequence is exactly
        input_ids[:n_tokens] and generate() must decode the prompt from there: the logits in
        the context belong to whatever ran last, never to the restored state. Returns the
        tokens kept (0 if the state could not be loaded)."""
        llm, lc = self._llm, self._lc
        mem = lc.llama_get_memory(llm.ctx)
        lc.llama_memory_seq_rm(mem, 0, 0, -1)
        buf = (ctypes.c_uint8 * len(st.data)).from_buffer_copy(st.data)
        if lc.llama_state_seq_set_data(llm.ctx, buf, len(st.data), 0) != len(st.data):
            llm.reset()
            return 0
        if keep < len(st.tokens) and not lc.llama_memory_seq_rm(mem, 0, keep, -1):
            llm.reset()  # this model's memory cannot be cut: recompute the whole prompt
            return 0
        llm.input_ids[:keep] = st.tokens[:keep]
        llm.n_tokens = keep
        return keep


def _same_kind(value: Any, default: Any) -> bool:
    """Whether an extra fits the parameter whose default is `default`."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, int | float) and math.isfinite(value)
    if isinstance(default, int):
        return isinstance(value, int)
    return False  # None or object defaults (processors, grammars): not for the command line


class LlamaTokenizer:
    """Tokenizer and chat template of a GGUF model, through llama.cpp's own vocabulary."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.closed = False
        meta = llm.metadata
        source = meta.get("tokenizer.chat_template")
        if not source:
            raise EngineError(f"{llm.model_path}: the GGUF carries no chat template")
        bos = llm.detokenize([llm.token_bos()], special=True).decode("utf-8", "replace")
        eos = llm.detokenize([llm.token_eos()], special=True).decode("utf-8", "replace")
        self.template = ChatTemplate(source, bos_token=bos, eos_token=eos)
        ids = {llm.token_eos()}
        for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            t = llm.tokenize(special.encode(), add_bos=False, special=True)
            if len(t) == 1:
                ids.add(t[0])
        self._eos = frozenset(ids)

    def _model(self) -> Any:
        if self.closed:
            raise EngineError("the engine is shut down; its tokenizer cannot be used")
        return self._llm

    def encode(self, text: str) -> list[int]:
        return self._model().tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def decode(self, ids: list[int]) -> str:
        return self._model().detokenize(ids, special=False).decode("utf-8", "replace")

    def token_text(self, token_id: int) -> str:
        return self._model().detokenize([token_id], special=True).decode("utf-8", "replace")

    def render(self, messages, tools=None, add_generation_prompt=True) -> str:
        return self.template.render(messages, tools, add_generation_prompt)

    @property
    def supports_tools(self) -> bool:
        return self.template.supports_tools

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos


def main(argv: list[str]) -> int:
    """run.py's main with this engine standing in for llama.cpp (`--engine llama.cpp`)."""
    from runner.cli import engines as cli_engines
    from runner.cli.main import main as cli_main
    from runner.engines.sglang.args import parse_engine_args

    def build(args: Any, tasks: Any) -> Any:
        engine = LlamaCppEngine(
            model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads, seed=args.seed,
            sampling_extra=parse_engine_args(args.sampling_arg, flag="--sampling-arg"),
        )  # fmt: skip
        return cli_engines.EngineSetup(engine, "bench: the one-at-a-time baseline")

    cli_engines.ENGINES["llama.cpp"] = build
    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
