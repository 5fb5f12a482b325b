"""The GPU engine: SGLang's offline `Engine` in process, token in and token out.

`SGLangEngine` starts `sglang.Engine(model_path=..., **server_args)` in this process (its
scheduler and detokenizer run as child processes) and talks to it only through calls that
are safe inside a running event loop:

- requests: `await engine.async_generate(input_ids=..., sampling_params=..., ...)`; the
  agent's ids go in unchanged and the engine's `output_ids` come back unchanged. No
  `return_logprob` / `logprob_start_len` is ever sent: prompt logprobs cap the radix-cache
  match and silently kill prefix reuse.
- signals: `engine.tokenizer_manager.load_snapshot_reader.read_all()` (a shared-memory read,
  one snapshot per DP rank) for U; on releases without it, `await tokenizer_manager.get_loads()`
  polled by a background task (see `cache_stats`).
- sessions: `await tokenizer_manager.close_session(CloseSessionReqInput(session_id=...))`.

The synchronous `Engine` helpers (`generate`, `get_server_info`, `flush_cache`,
`open_session`, `close_session`, ...) call `loop.run_until_complete` and must never run
inside the runner's event loop; this module never calls them. `engine.shutdown()` is the
one synchronous call, made once from `aclose()` in a worker thread.

sglang is imported lazily inside `SGLangEngine.__init__`, so this module imports (and its
tests run) on machines without SGLang or a GPU. docs/sglang.md lists every SGLang call and
key used here with the source file it comes from.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import itertools
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..engine import CacheStats, ContextLimitExceeded, EngineError, Generation, SamplingParams

log = logging.getLogger("concur")

INSTALL_HINT = "pip install 'concur-runner[sglang]' (or: pip install sglang)"
DP_ASSIGN = ("round_robin", "least_loaded")
# Sampling keys the adapter owns: a per-run extra may not override them.
OWNED_SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "stop"})
# SGLang takes one decoding constraint per request; with --constrain-tool-calls the adapter
# sends `structural_tag` itself, so an extra may not add another.
CONSTRAINT_KEYS = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})
TOOL_CALL_BEGIN, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# Request options that cap prefix reuse; never sent, and refused as extras.
LOGPROB_KEYS = frozenset(
    {"return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob"}
)
# Single-token end-of-turn markers of common chat templates (added to eos_ids when the
# template writes them).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
# Substrings of SGLang's own context-length refusals (tokenizer_manager._validate_one_request,
# scheduler validate_input_length).
_CONTEXT_ERRORS = ("context length", "maximum allowed length")
# The session radix cache lives in the unified radix tree, which this env var enables.
UNIFIED_TREE_ENV = "SGLANG_ENABLE_UNIFIED_RADIX_TREE"


# ---- helpers the CLI uses ---------------------------------------------------------------


def parse_value(text: str) -> Any:
    """An --engine-arg value: true/false -> bool, none/null -> None, int, float, else str.
    Quote a value ('"1"') to keep it a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    with contextlib.suppress(ValueError):
        value = float(text)
        if value == value and value not in (float("inf"), float("-inf")):
            return value
    return text


def parse_engine_args(items: list[str] | None, flag: str = "--engine-arg") -> dict[str, Any]:
    """`["tp_size=2", "enable-hierarchical-cache=true"]` -> `{"tp_size": 2, ...}`.

    Keys may be written with dashes or a leading `--` (as on SGLang's own command line);
    they become ServerArgs field names. Values are parsed by `parse_value`. Raises ValueError
    with a message naming the offending item."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} tp_size=2")
        raw_key, raw_value = item.split("=", 1)
        key = raw_key.strip().removeprefix("--").replace("-", "_")
        if not key:
            raise ValueError(f"{flag} {item!r}: the key is empty")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{flag} {item!r}: {raw_key.strip()!r} is not a valid argument name")
        if key in out:
            raise ValueError(f"{flag} {key!r} is given twice")
        out[key] = parse_value(raw_value)
    return out


def sglang_available() -> tuple[bool, str]:
    """Whether `--engine auto` may pick SGLang here: the package is installed and a CUDA GPU is
    visible. -> (ok, reason). Checks the GPU with torch when torch imports, else by the
    presence of nvidia-smi. Never imports sglang itself (slow, and it sets uvloop as the
    event loop policy)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, f"sglang is not installed ({INSTALL_HINT})"
    try:
        import torch
    except Exception:
        torch = None
    if torch is not None:
        try:
            ok = bool(torch.cuda.is_available())
        except Exception as e:
            return False, f"sglang is installed but torch cannot query CUDA ({e})"
        if ok:
            return True, "sglang is installed and torch sees a CUDA GPU"
        return False, "sglang is installed but torch sees no CUDA GPU"
    if shutil.which("nvidia-smi"):
        return True, "sglang is installed and nvidia-smi is present (torch did not import)"
    return False, "sglang is installed but no CUDA GPU is visible (no torch, no nvidia-smi)"


# ---- the tokenizer ----------------------------------------------------------------------


class SGLangTokenizer:
    """The runner's Tokenizer over the Hugging Face tokenizer SGLang loaded
    (`engine.tokenizer_manager.tokenizer`), so ids agree with the engine by construction."""

    def __init__(self, hf: Any, model_eos: Any = None) -> None:
        if hf is None:
            raise EngineError(
                "SGLang has no tokenizer (skip_tokenizer_init=True?); the runner needs it"
            )
        self.hf = hf
        source = getattr(hf, "chat_template", None)
        if isinstance(source, dict):  # named templates (e.g. "default", "tool_use")
            source = "\n".join(str(v) for v in source.values())
        self.template_source: str = source or ""
        self._eos = self._find_eos(model_eos)

    def _find_eos(self, model_eos: Any) -> frozenset[int]:
        ids: set[int] = set()
        eos = getattr(self.hf, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        if isinstance(model_eos, int):
            ids.add(model_eos)
        elif model_eos:  # generation config: a set or list of ids
            ids.update(int(t) for t in model_eos)
        unk = getattr(self.hf, "unk_token_id", None)
        for tok in END_OF_TURN_TOKENS:
            if tok not in self.template_source:
                continue
            try:
                tid = self.hf.convert_tokens_to_ids(tok)
            except Exception:
                continue
            if isinstance(tid, int) and tid >= 0 and tid != unk:
                ids.add(tid)
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if not self.template_source:
            raise EngineError("the model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages,
            tools=tools if tools and self.supports_tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    @property
    def supports_tools(self) -> bool:
        return "tools" in self.template_source

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos


# ---- the engine -------------------------------------------------------------------------


def _field(obj: Any, name: str) -> Any:
    """A field of a load snapshot: msgspec Struct / dataclass attribute, or dict key."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


class SGLangEngine:
    """SGLang in process behind the runner's Engine protocol.

    Server args pass through: `tp_size`, `dp_size`, `mem_fraction_static` and any ServerArgs
    field in `engine_args` (from `--engine-arg key=value`), e.g. the HiCache flags
    `enable_hierarchical_cache`, `hicache_ratio`, `hicache_size`, `hicache_write_policy`, or
    `radix_eviction_policy`, `max_total_tokens`, `schedule_policy`.

    Per-agent features need the agent's key on each request: `generate(ids, sampling,
    agent=key)`, and `await end_agent(key)` once the agent has ended. Without a key a request
    is plain (no session, SGLang's own DP balancing, no priority). Opt-ins:

    - `sessions=True`: one stable `session_id` per agent with SGLang's session radix cache
      (sets `enable_session_radix_cache=True`, and SGLANG_ENABLE_UNIFIED_RADIX_TREE=1 unless
      already set). The session opens implicitly with the agent's first request and is
      closed once by `end_agent` (or by `aclose`). Soft protection only: unreferenced KV is
      evicted first; nothing is pinned.
    - `priority`: an int for every request, "fifo" (agents first seen earlier get higher
      priority), or a callable `agent -> int | None`. Sets `enable_priority_scheduling=True`.
    - DP (`dp_size > 1`): each agent is routed to one rank for its whole life
      (`routed_dp_rank`), assigned on its first request by `dp_assign` ("round_robin" or
      "least_loaded": fewest live agents, then lowest token_usage). `rank_of(key)` says where.

    Shutdown: `aclose()` closes open sessions, then calls `engine.shutdown()` once, which
    SIGKILLs EVERY descendant of this process (SGLang's kill_process_tree), tool processes
    included. End all tool processes (sandbox.aclose()) before calling it.
    """

    name = "sglang"
    # SamplingParams.tool_call_schema becomes an xgrammar structural tag (see _sampling_params)
    constrains_tool_calls = True

    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int | None = None,
        dp_size: int | None = None,
        mem_fraction_static: float | None = None,
        engine_args: dict[str, Any] | None = None,
        sessions: bool = False,
        priority: int | str | Callable[[str], int | None] | None = None,
        dp_assign: str = "round_robin",
        sampling_extra: dict[str, Any] | None = None,
        stop_on_eos_ids: bool = True,
        loads_refresh_s: float = 0.5,
        engine_factory: Callable[..., Any] | None = None,
    ) -> None:
        if dp_assign not in DP_ASSIGN:
            raise ValueError(f"dp_assign must be one of {DP_ASSIGN}, got {dp_assign!r}")
        if isinstance(priority, bool) or (isinstance(priority, str) and priority != "fifo"):
            raise ValueError(f"priority must be an int, 'fifo' or a callable, got {priority!r}")
        extra = dict(sampling_extra or {})
        bad = sorted(set(extra) & (OWNED_SAMPLING_KEYS | LOGPROB_KEYS))
        if bad:
            raise ValueError(
                f"sampling extras may not set {bad}: the runner owns them (or they would cap "
                "prefix reuse)"
            )
        kwargs = self._server_args(
            model_path, tp_size, dp_size, mem_fraction_static, engine_args, sessions, priority
        )
        if sessions:
            os.environ.setdefault(UNIFIED_TREE_ENV, "1")
        if engine_factory is None:
            engine_factory = self._import_engine()
        try:
            self._engine = engine_factory(**kwargs)
        except TypeError as e:
            raise EngineError(f"SGLang rejected the server arguments: {e}") from e
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"SGLang failed to start: {type(e).__name__}: {e}") from e
        self.server_kwargs = kwargs
        eng = self._engine
        tm = eng.tokenizer_manager
        self._tm = tm
        sa = getattr(eng, "server_args", None) or getattr(tm, "server_args", None)
        self._server_args_obj = sa
        model_config = getattr(tm, "model_config", None)
        self._tok = SGLangTokenizer(
            getattr(tm, "tokenizer", None), getattr(model_config, "hf_eos_token_id", None)
        )
        self.model = str(getattr(tm, "served_model_name", None) or model_path)
        self.model_path = model_path
        limit = (
            getattr(tm, "context_len", None)
            or getattr(model_config, "context_len", None)
            or getattr(sa, "context_length", None)
        )
        if not isinstance(limit, int) or limit <= 0:
            raise EngineError("cannot read the context length from SGLang")
        self.context_limit = limit
        self._reserved = int(getattr(tm, "num_reserved_tokens", 0) or 0)
        max_in = getattr(tm, "max_req_input_len", None)
        self._max_input = max_in if isinstance(max_in, int) and max_in > 0 else None

        params = self._generate_params(eng)
        self._dp_size = int(getattr(sa, "dp_size", 1) or 1)
        self._rank_kw: str | None = None
        if self._dp_size > 1:
            for kw in ("routed_dp_rank", "data_parallel_rank"):
                if params is None or kw in params:
                    self._rank_kw = kw
                    break
        self._sessions_on = sessions
        self._close_req: Any = None
        if sessions:
            if params is not None and "session_id" not in params:
                raise EngineError(
                    "sessions need an SGLang whose async_generate takes a top-level session_id "
                    "(the session radix cache); upgrade sglang or run without sessions"
                )
            try:
                io_struct = importlib.import_module("sglang.srt.managers.io_struct")
                self._close_req = io_struct.CloseSessionReqInput
            except (ImportError, AttributeError) as e:
                raise EngineError(f"sessions: cannot import CloseSessionReqInput ({e})") from e
        if priority is not None and params is not None and "priority" not in params:
            raise EngineError("this SGLang's async_generate takes no request priority")
        self._priority = priority
        self._low_first = bool(getattr(sa, "schedule_low_priority_values_first", False))
        self._dp_assign = dp_assign
        self._sampling_extra = extra
        self._structural_tags: dict[str, str] = {}  # tool-call schema -> structural tag
        self._stop_ids = sorted(self._tok.eos_ids) if stop_on_eos_ids else []
        self._loads_refresh_s = loads_refresh_s

        # per-agent state
        self._session_prefix = f"concur-{uuid.uuid4().hex[:8]}-"
        self._session_ids: dict[str, str] = {}
        self._ranks: dict[str, int] = {}
        self._rank_agents = [0] * self._dp_size
        self._rr = itertools.count()
        self._first_seen: dict[str, int] = {}
        self._seen = itertools.count()

        # signals
        reader = getattr(tm, "load_snapshot_reader", None)
        if reader is not None and callable(getattr(reader, "read_all", None)):
            self._usage_source = "load_snapshot_reader"
            self._reader = reader
        elif callable(getattr(tm, "get_loads", None)):
            self._usage_source = "get_loads"
            self._reader = None
        else:
            self._usage_source = "unavailable"
            self._reader = None
        self._loads: list[Any] = []
        self._loads_at: float | None = None
        self._loads_error: str | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._last_stats = CacheStats(usage=None, extra={"usage_source": self._usage_source})

        self._counts = {
            "requests": 0,
            "aborted": 0,
            "failed": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "cached_host_tokens": 0,
            "sessions_closed": 0,
            "session_close_errors": 0,
            "dp_rank_mismatch": 0,
        }
        self._closed = False
        self._shutdown_done = False

    # ---- construction helpers ----------------------------------------------------------

    @staticmethod
    def _import_engine() -> Callable[..., Any]:
        try:
            sglang = importlib.import_module("sglang")
        except ImportError as e:
            raise EngineError(f"the SGLang engine needs sglang: {INSTALL_HINT} ({e})") from None
        factory = getattr(sglang, "Engine", None)
        if factory is None:
            raise EngineError(f"this sglang has no sglang.Engine; {INSTALL_HINT}")
        return factory

    @staticmethod
    def _server_args(
        model_path: str,
        tp_size: int | None,
        dp_size: int | None,
        mem_fraction_static: float | None,
        engine_args: dict[str, Any] | None,
        sessions: bool,
        priority: Any,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(engine_args or {})
        named = {
            "model_path": model_path,
            "tp_size": tp_size,
            "dp_size": dp_size,
            "mem_fraction_static": mem_fraction_static,
        }
        if sessions:
            named["enable_session_radix_cache"] = True
        if priority is not None:
            named["enable_priority_scheduling"] = True
        for key, value in named.items():
            if value is None:
                continue
            if key in kwargs and kwargs[key] != value:
                raise ValueError(
                    f"engine argument {key}={kwargs[key]!r} conflicts with {key}={value!r}"
                    + (" (needed by an opt-in)" if isinstance(value, bool) else "")
                )
            kwargs[key] = value
        bad = sorted(set(kwargs) & LOGPROB_KEYS)
        if bad:
            raise ValueError(f"{bad} are request options, not server arguments")
        return kwargs

    @staticmethod
    def _generate_params(eng: Any) -> set[str] | None:
        """Keyword names async_generate takes, or None when it takes **kwargs / is opaque."""
        try:
            sig = inspect.signature(eng.async_generate)
        except (TypeError, ValueError):
            return None
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            return None
        return set(sig.parameters)

    # ---- the Engine protocol -----------------------------------------------------------

    @property
    def tokenizer(self) -> SGLangTokenizer:
        return self._tok

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, agent: str | None = None
    ) -> Generation:
        """One request. `agent`: the agent's key (sessions, sticky DP rank, priority)."""
        if self._closed:
            raise EngineError("engine is shut down")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise EngineError("empty prompt")
        n, limit = len(ids), self.context_limit
        if n + self._reserved >= limit or (self._max_input is not None and n >= self._max_input):
            raise ContextLimitExceeded(
                f"prompt of {n} tokens leaves no room in the {limit}-token context"
            )
        max_new = min(sampling.max_new_tokens, limit - self._reserved - n)
        if max_new < 1:
            raise ContextLimitExceeded(f"prompt of {n} tokens fills the {limit}-token context")
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": self._sampling_params(sampling, max_new),
        }
        rank = None
        if agent is not None:
            kwargs.update(self._agent_options(agent))
            rank = self._ranks.get(agent)
        self._ensure_refresher()
        t0 = time.perf_counter()
        try:
            out = await self._engine.async_generate(**kwargs)
        except ValueError as e:
            self._counts["failed"] += 1
            if any(s in str(e).lower() for s in _CONTEXT_ERRORS):
                raise ContextLimitExceeded(str(e)) from None
            raise EngineError(f"SGLang refused the request: {e}") from None
        except Exception as e:  # fastapi.HTTPException for 503/500 aborts, ZMQ errors, ...
            self._counts["failed"] += 1
            raise EngineError(f"SGLang request failed: {type(e).__name__}: {e}") from None
        return self._generation(out, ids, t0, rank)

    def cache_stats(self) -> CacheStats:
        """Cheap, non-blocking. U = the highest `token_usage` over DP ranks (tokens held by
        running requests and locked prefixes / pool size; evictable radix-cache tokens are NOT
        counted), per-rank values in extra["ranks"] and extra["rank_usage"].

        Source: the shared-memory load snapshots (`load_snapshot_reader.read_all()`, read here,
        synchronously: a few mmap'd bytes under a shared flock). On releases without them,
        a background task started on first use (first `generate` or `cache_stats` inside the
        event loop) polls `await tokenizer_manager.get_loads()` every `loads_refresh_s` and
        this returns the latest answer (None until the first one arrives)."""
        if self._closed:  # the engine is gone: counters, and the last loads read
            self._last_stats = self._stats()
            self._last_stats.extra["closed"] = True
            return self._last_stats
        if self._usage_source == "load_snapshot_reader":
            try:
                self._loads = list(self._reader.read_all())
                self._loads_at = time.monotonic()
                self._loads_error = None
            except Exception as e:
                self._loads_error = f"{type(e).__name__}: {e}"
        elif self._usage_source == "get_loads":
            self._ensure_refresher()
        self._last_stats = self._stats()
        return self._last_stats

    async def aclose(self) -> None:
        """Close every open session, then `engine.shutdown()` once (in a worker thread: it
        blocks until the GPU is released). shutdown() SIGKILLs every descendant of this
        process, so tool processes must have ended before. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresher
            self._refresher = None
        for agent in list(self._session_ids):
            await self._release(agent)
        if not self._shutdown_done:
            self._shutdown_done = True
            await asyncio.get_running_loop().run_in_executor(None, self._engine.shutdown)

    # ---- per-agent hooks (protocol extension) -------------------------------------------

    async def end_agent(self, agent: str) -> None:
        """The agent ended (any status): close its session, free its DP slot. Idempotent,
        never raises."""
        await self._release(agent)

    def rank_of(self, agent: str) -> int | None:
        """The DP rank the agent's requests go to, or None (dp_size 1, not seen yet, ended)."""
        return self._ranks.get(agent)

    def assign_rank(self, agent: str, rank: int | None = None) -> int | None:
        """The agent's DP rank, assigned now if it has none: `rank` when the per-rank gate
        chose it at admission, else by --dp-assign. Sticky until `end_agent`. None without
        DP."""
        if self._rank_kw is None:
            return None
        current = self._ranks.get(agent)
        if current is None:
            if rank is not None and not 0 <= rank < self._dp_size:
                raise ValueError(f"DP rank {rank} out of range 0..{self._dp_size - 1}")
            current = self._ranks[agent] = self._pick_rank() if rank is None else rank
            self._rank_agents[current] += 1
        return current

    def rank_stats(self, rank: int) -> CacheStats:
        """One DP rank's signals, for its own gate window: its `token_usage` and pool size
        (from the same snapshot `cache_stats` just read)."""
        whole = self.cache_stats()
        cap = None
        for i, snap in enumerate(self._loads):
            r = _field(snap, "dp_rank")
            if (r if isinstance(r, int) else i) == rank:
                v = _num(_field(snap, "max_total_num_tokens"))
                cap = int(v) if v is not None else None
        usage = whole.extra["rank_usage"][rank] if rank < len(whole.extra["rank_usage"]) else None
        return CacheStats(usage=usage, capacity_tokens=cap, extra={"dp_rank": rank})

    @property
    def dp_size(self) -> int:
        return self._dp_size

    # ---- internals ---------------------------------------------------------------------

    def _sampling_params(self, sp: SamplingParams, max_new: int) -> dict[str, Any]:
        d: dict[str, Any] = {
            "max_new_tokens": max_new,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
        }
        if sp.stop:
            d["stop"] = list(sp.stop)
        if self._stop_ids:
            d["stop_token_ids"] = list(self._stop_ids)
        d.update(self._sampling_extra)
        if sp.tool_call_schema:
            clash = sorted(CONSTRAINT_KEYS & self._sampling_extra.keys())
            if clash:
                raise EngineError(
                    f"--sampling-arg {clash[0]} and constrained tool calls both constrain "
                    "decoding; SGLang takes one per request (drop one, or "
                    "--constrain-tool-calls off)"
                )
            d["structural_tag"] = self._structural_tag(sp.tool_call_schema)
        return d

    def _structural_tag(self, schema: str) -> str:
        """The reply as exactly one `<tool_call>{...}</tool_call>` whose object matches the
        schema: an xgrammar structural tag (the "format" form SGLang's xgrammar backend
        compiles as given). Built once per schema."""
        tag = self._structural_tags.get(schema)
        if tag is None:
            fmt = {
                "type": "tag",
                "begin": TOOL_CALL_BEGIN,
                "content": {"type": "json_schema", "json_schema": json.loads(schema)},
                "end": TOOL_CALL_END,
            }
            tag = json.dumps({"type": "structural_tag", "format": fmt})
            self._structural_tags[schema] = tag
        return tag

    def _agent_options(self, agent: str) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if agent not in self._first_seen:
            self._first_seen[agent] = next(self._seen)
        if self._sessions_on:
            sid = self._session_ids.get(agent)
            if sid is None:  # opened implicitly by SGLang on this first request
                sid = self._session_ids[agent] = self._session_prefix + agent
            opts["session_id"] = sid
        rank = self.assign_rank(agent)
        if rank is not None:
            opts[self._rank_kw] = rank
        prio = self._priority_of(agent)
        if prio is not None:
            opts["priority"] = prio
        return opts

    def _pick_rank(self) -> int:
        if self._dp_assign == "round_robin":
            return next(self._rr) % self._dp_size
        if self._usage_source == "load_snapshot_reader":
            with contextlib.suppress(Exception):
                self._loads = list(self._reader.read_all())
                self._loads_at = time.monotonic()
        usage = self._rank_usage()
        return min(
            range(self._dp_size),
            key=lambda r: (self._rank_agents[r], usage[r] if usage[r] is not None else 0.0, r),
        )

    def _priority_of(self, agent: str) -> int | None:
        p = self._priority
        if p is None:
            return None
        if isinstance(p, int) and not isinstance(p, bool):
            return p
        if p == "fifo":
            order = self._first_seen[agent]
            return order if self._low_first else -order
        if callable(p):
            return p(agent)
        return None

    async def _release(self, agent: str) -> None:
        rank = self._ranks.pop(agent, None)
        if rank is not None:
            self._rank_agents[rank] -= 1
        self._first_seen.pop(agent, None)
        sid = self._session_ids.pop(agent, None)
        if sid is None or self._shutdown_done:
            return
        try:
            await self._tm.close_session(self._close_req(session_id=sid), None)
            self._counts["sessions_closed"] += 1
        except Exception as e:  # a failed close only costs the soft protection
            self._counts["session_close_errors"] += 1
            log.warning("SGLang close_session(%s) failed: %s: %s", sid, type(e).__name__, e)

    def _generation(self, out: Any, ids: list[int], t0: float, rank: int | None) -> Generation:
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            self._counts["failed"] += 1
            raise EngineError(f"unexpected SGLang result: {type(out).__name__}")
        meta = out["meta_info"]
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else fr
        if ftype == "abort":
            self._counts["aborted"] += 1
            msg = fr.get("message") if isinstance(fr, dict) else None
            if msg and any(s in str(msg).lower() for s in _CONTEXT_ERRORS):
                raise ContextLimitExceeded(str(msg))
            raise EngineError(f"SGLang aborted the request: {msg or 'no reason given'}")
        output_ids = [int(t) for t in out.get("output_ids") or []]
        matched = fr.get("matched") if isinstance(fr, dict) else None
        matched_ids = {matched} if isinstance(matched, int) else set()
        if isinstance(matched, list):
            matched_ids = {m for m in matched if isinstance(m, int)}
        # SGLang keeps the matched stop token in output_ids ("stop position is included");
        # it is an end of turn when it is one of the tokenizer's eos ids.
        stopped_on_eos = (
            ftype == "stop"
            and bool(output_ids)
            and output_ids[-1] in matched_ids
            and output_ids[-1] in self._tok.eos_ids
        )
        details = meta.get("cached_tokens_details") or {}
        host = 0
        if isinstance(details, dict):
            host = int(details.get("host") or 0) + int(details.get("storage") or 0)
        prompt = int(meta.get("prompt_tokens", len(ids)))
        cached = int(meta.get("cached_tokens") or 0)
        latency = _num(meta.get("e2e_latency"))
        got_rank = meta.get("dp_rank")
        if rank is not None and isinstance(got_rank, int) and got_rank != rank:
            self._counts["dp_rank_mismatch"] += 1
        c = self._counts
        c["requests"] += 1
        c["prompt_tokens"] += prompt
        c["cached_tokens"] += cached
        c["cached_host_tokens"] += host
        visible = output_ids[:-1] if stopped_on_eos else output_ids
        return Generation(
            output_ids=output_ids,
            text=self._tok.decode(visible),
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            finish_reason="length" if ftype == "length" else "stop",
            seconds=latency if latency is not None else time.perf_counter() - t0,
            cached_host_tokens=host,
            stopped_on_eos=stopped_on_eos,
        )

    # signals

    def _ensure_refresher(self) -> None:
        if self._usage_source != "get_loads" or self._refresher is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (e.g. the final summary): keep the last value
        self._refresher = loop.create_task(self._refresh_loads(), name="sglang-get-loads")

    async def _refresh_loads(self) -> None:
        while not self._closed:
            try:
                self._loads = list(await self._tm.get_loads())
                self._loads_at = time.monotonic()
                self._loads_error = None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._loads_error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(self._loads_refresh_s)

    def _rank_usage(self) -> list[float | None]:
        usage: list[float | None] = [None] * self._dp_size
        for i, snap in enumerate(self._loads):
            r = _field(snap, "dp_rank")
            r = r if isinstance(r, int) and 0 <= r < self._dp_size else i
            if r < self._dp_size:
                usage[r] = _num(_field(snap, "token_usage"))
        return usage

    def _stats(self) -> CacheStats:
        ranks = []
        for snap in self._loads:
            ranks.append(
                {
                    k: _field(snap, k)
                    for k in (
                        "dp_rank",
                        "token_usage",
                        "num_used_tokens",
                        "max_total_num_tokens",
                        "num_running_reqs",
                        "num_waiting_reqs",
                        "timestamp",
                    )
                }
            )
        values = [u for u in (_num(r["token_usage"]) for r in ranks) if u is not None]
        used = [int(r["num_used_tokens"]) for r in ranks if _num(r["num_used_tokens"]) is not None]
        cap = [
            int(r["max_total_num_tokens"])
            for r in ranks
            if _num(r["max_total_num_tokens"]) is not None
        ]
        c = self._counts
        extra: dict[str, Any] = {
            "usage_source": self._usage_source,
            "usage_agg": "max over DP ranks of token_usage",
            "usage_mean": sum(values) / len(values) if values else None,
            "ranks": ranks,
            "rank_usage": self._rank_usage(),
            "dp_size": self._dp_size,
            "agents_per_rank": list(self._rank_agents),
            "loads_age_s": (
                round(time.monotonic() - self._loads_at, 3) if self._loads_at is not None else None
            ),
            "physical_usage": None,
            "physical_note": (
                "not read in process: physical occupancy (evictable radix-cache tokens "
                "included) needs enable_metrics=True and a Prometheus multiprocess read of the "
                "kv_used/kv_evictable/kv_available token gauges"
            ),
            "sessions_open": len(self._session_ids),
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else None,
            **c,
        }
        if self._loads_error:
            extra["usage_error"] = self._loads_error
        if self._usage_source != "unavailable" and not ranks:
            extra["usage_note"] = "no load snapshot yet"
        if self._dp_size > 1 and self._rank_kw is None:
            extra["dp_routing"] = "unsupported by this SGLang (no routed_dp_rank)"
        return CacheStats(
            usage=max(values) if values else None,
            capacity_tokens=sum(cap) if cap else None,
            used_tokens=sum(used) if used else None,
            extra=extra,
        )


# ---- command line -----------------------------------------------------------------------


def add_sglang_arguments(group: Any) -> None:
    """The SGLang flags, for an argparse group (cli.py's "engine" group)."""
    group.add_argument("--tp-size", "--tp", type=int, help="SGLang tensor parallel size")
    group.add_argument(
        "--dp-size",
        "--dp",
        type=int,
        help="SGLang data parallel size; each agent stays on one DP rank for its life",
    )
    group.add_argument(
        "--mem-fraction-static",
        "--mem-fraction",
        type=float,
        help="SGLang: GPU memory fraction for weights + KV",
    )
    group.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any SGLang ServerArgs field (repeatable), e.g. enable_hierarchical_cache=true "
        "hicache_ratio=2 radix_eviction_policy=priority; values parse as int/float/bool/str",
    )
    group.add_argument(
        "--sampling-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra SGLang sampling parameter for every request (repeatable), e.g. top_k=20",
    )
    group.add_argument(
        "--sglang-sessions",
        action="store_true",
        help="one SGLang session per agent (session radix cache: the agent's KV is evicted "
        "after unreferenced KV; closed when the agent ends)",
    )
    group.add_argument(
        "--sglang-priority",
        help="request priority: 'fifo' (agents started earlier first) or an int for all",
    )
    group.add_argument(
        "--dp-assign",
        choices=list(DP_ASSIGN),
        default="round_robin",
        help="how an agent's DP rank is picked on its first request",
    )


def sglang_engine_from_args(args: Any) -> SGLangEngine:
    """Build the engine from the flags of `add_sglang_arguments` plus --model."""
    if not getattr(args, "model", None):
        raise ValueError("--engine sglang needs --model (a Hugging Face model name or path)")
    priority: int | str | None = args.sglang_priority
    if priority is not None and priority != "fifo":
        try:
            priority = int(priority)
        except ValueError:
            raise ValueError(
                f"--sglang-priority must be 'fifo' or an int, got {priority!r}"
            ) from None
    return SGLangEngine(
        args.model,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        mem_fraction_static=args.mem_fraction_static,
        engine_args=parse_engine_args(args.engine_arg),
        sampling_extra=parse_engine_args(args.sampling_arg, flag="--sampling-arg"),
        sessions=args.sglang_sessions,
        priority=priority,
        dp_assign=args.dp_assign,
    )
