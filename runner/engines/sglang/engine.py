"""SGLangEngine: SGLang's offline `Engine` in process behind the runner's Engine protocol."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import importlib
import inspect
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from ...chat import toolcall
from ..protocol import (
    CacheStats,
    ContextLimitExceeded,
    EngineError,
    Generation,
    SamplingParams,
    TransientEngineError,
)
from . import versions
from .loads import LoadSnapshots, number
from .tokenizer import SGLangTokenizer

log = logging.getLogger("concur")

INSTALL_HINT = "pip install 'concur-runner[sglang]' (or: pip install sglang)"
DP_ASSIGN = ("round_robin", "least_loaded")
# Sampling keys the adapter owns: a per-run extra may not override them.
OWNED_SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "stop"})
# SGLang takes one decoding constraint per request; with --constrain-tool-calls the adapter
# sends `structural_tag` itself, so an extra may not add another.
CONSTRAINT_KEYS = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})
TOOL_CALL_BEGIN, TOOL_CALL_END = toolcall.OPEN, toolcall.CLOSE
# Request options for logprobs. Only `return_logprob` is ever sent (SamplingParams.logprobs):
# alone it makes SGLang start logprobs at the first output token, which leaves the prefix
# match at input_len - 1. A `logprob_start_len` inside the prompt would cap the match there
# and silently kill prefix reuse; top-k and per-id logprobs have no place in Generation.
# So none of these may come in as an extra or a server argument.
LOGPROB_KEYS = frozenset(
    {"return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob"}
)
# Substrings of SGLang's own context-length refusals (tokenizer_manager._validate_one_request,
# scheduler validate_input_length).
_CONTEXT_ERRORS = ("context length", "maximum allowed length")
# SamplingParams fields SGLang fills itself (normalize()); not for callers to set.
INTERNAL_SAMPLING_FIELDS = frozenset(
    {
        "stop_strs",
        "stop_regex_strs",
        "stop_str_max_len",
        "stop_regex_max_len",
        "is_normalized",
        "ebnf_full_assistant",
    }
)
_COUNTERS = (
    "requests",
    "aborted",
    "failed",
    "transient",
    "prompt_tokens",
    "cached_tokens",
    "cached_host_tokens",
    "sessions_closed",
    "session_close_errors",
    "dp_rank_mismatch",
)
_PHYSICAL_NOTE = (
    "not read in process: physical occupancy (evictable radix-cache tokens included) needs "
    "enable_metrics=True and a Prometheus multiprocess read of the "
    "kv_used/kv_evictable/kv_available token gauges"
)


class SGLangEngine:
    """SGLang in process behind the runner's Engine protocol, with the DataParallel,
    ConstrainedDecoding and TokenLogprobs capabilities.

    Server args pass through: `tp_size`, `dp_size`, `mem_fraction_static` and any ServerArgs
    field in `engine_args` (from `--engine-arg key=value`), e.g. the HiCache flags
    `enable_hierarchical_cache`, `hicache_ratio`, `hicache_size`, `hicache_write_policy`, or
    `radix_eviction_policy`, `max_total_tokens`, `schedule_policy`.

    Per-agent features need the agent's key on each request: `generate(ids, sampling,
    agent=key)`, and `await end_agent(key)` once the agent has ended. Without a key a request
    is plain (no session, SGLang's own DP balancing, no priority). Opt-ins:

    - `sessions=True`: one stable `session_id` per agent with SGLang's session radix cache
      (sets `enable_session_radix_cache=True`, plus what the installed release needs for it:
      see versions.py). The session opens implicitly with the agent's first request and is
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
        _check_choices(dp_assign, priority)
        extra = _checked_sampling_extra(sampling_extra)
        opt_in_args, env = _opt_in_requirements(sessions, priority)
        named = {
            "model_path": model_path,
            "tp_size": tp_size,
            "dp_size": dp_size,
            "mem_fraction_static": mem_fraction_static,
        }
        self.server_kwargs = server_args(named, opt_in_args, engine_args)
        for key, value in env.items():
            os.environ.setdefault(key, value)
        self._engine = _start(engine_factory or _import_engine(), self.server_kwargs)
        self._read_engine(model_path)
        params = _generate_params(self._engine)
        self._init_dp(params, dp_assign)
        self._init_sessions(params, sessions)
        self._init_priority(params, priority)
        self._gives_logprobs = params is None or "return_logprob" in params
        self._sampling_extra = extra
        self._structural_tags: dict[str, str] = {}  # tool-call schema -> structural tag
        self._stop_ids = sorted(self._tok.eos_ids) if stop_on_eos_ids else []
        self._loads = LoadSnapshots(self._tm, loads_refresh_s)
        self._last_stats = CacheStats(usage=None, extra={"usage_source": self._loads.source})
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._shutdown_done = False

    # ---- construction steps ------------------------------------------------------------

    def _read_engine(self, model_path: str) -> None:
        """Tokenizer, model name and context limits from the started engine."""
        tm = self._tm = self._engine.tokenizer_manager
        sa = getattr(self._engine, "server_args", None) or getattr(tm, "server_args", None)
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

    def _init_dp(self, params: set[str] | None, dp_assign: str) -> None:
        """DP size and the rank keyword this release takes (routed_dp_rank since 0.5.10)."""
        self._dp_size = int(getattr(self._server_args_obj, "dp_size", 1) or 1)
        self._rank_kw: str | None = None
        if self._dp_size > 1:
            for kw in ("routed_dp_rank", "data_parallel_rank"):
                if params is None or kw in params:
                    self._rank_kw = kw
                    break
        self._dp_assign = dp_assign
        self._ranks: dict[str, int] = {}
        self._rank_agents = [0] * self._dp_size
        self._rr = itertools.count()

    def _init_sessions(self, params: set[str] | None, sessions: bool) -> None:
        self._sessions_on = sessions
        self._close_req: Any = None
        self._session_prefix = f"concur-{uuid.uuid4().hex[:8]}-"
        self._session_ids: dict[str, str] = {}
        if not sessions:
            return
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

    def _init_priority(self, params: set[str] | None, priority: Any) -> None:
        if priority is not None and params is not None and "priority" not in params:
            raise EngineError("this SGLang's async_generate takes no request priority")
        self._priority = priority
        sa = self._server_args_obj
        self._low_first = bool(getattr(sa, "schedule_low_priority_values_first", False))
        self._first_seen: dict[str, int] = {}
        self._seen = itertools.count()

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
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": self._sampling_params(sampling, self._room(ids, sampling)),
        }
        if sampling.logprobs:
            if not self._gives_logprobs:
                raise EngineError("this SGLang's async_generate takes no return_logprob")
            kwargs["return_logprob"] = True
        rank = None
        if agent is not None:
            kwargs.update(self._agent_options(agent))
            rank = self._ranks.get(agent)
        self._loads.ensure_polling()
        t0 = time.perf_counter()
        out = await self._request(kwargs)
        return self._generation(out, ids, t0, rank, sampling.logprobs)

    async def end_agent(self, agent: str) -> None:
        """The agent ended (any status): close its session, free its DP slot. Idempotent,
        never raises."""
        await self._release(agent)

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
        self._loads.refresh()
        self._last_stats = self._stats()
        return self._last_stats

    async def aclose(self) -> None:
        """Close every open session, then `engine.shutdown()` once (in a worker thread: it
        blocks until the GPU is released). shutdown() SIGKILLs every descendant of this
        process, so tool processes must have ended before. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._loads.aclose()
        for agent in list(self._session_ids):
            await self._release(agent)
        if not self._shutdown_done:
            self._shutdown_done = True
            await asyncio.get_running_loop().run_in_executor(None, self._engine.shutdown)

    # ---- capabilities: DataParallel, ConstrainedDecoding, TokenLogprobs ----------------

    @property
    def dp_size(self) -> int:
        return self._dp_size

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
        cap = self._loads.rank_capacity(rank)
        per_rank = whole.extra["rank_usage"]
        usage = per_rank[rank] if rank < len(per_rank) else None
        return CacheStats(usage=usage, capacity_tokens=cap, extra={"dp_rank": rank})

    @property
    def constrain_by_default(self) -> bool:
        """SamplingParams.tool_call_schema becomes an xgrammar structural tag, but not by
        default: the forced call would also forbid a reasoning model's <think> block."""
        return False

    @property
    def gives_logprobs(self) -> bool:
        """Whether this release's async_generate takes return_logprob."""
        return self._gives_logprobs

    def check_sampling(self, sampling: SamplingParams) -> None:
        """What a request with `sampling` would send (the `sampling_extra` options included),
        through SGLang's own SamplingParams as the tokenizer manager builds it for every
        request (`sampling_params_class(**params)`, `.normalize(tokenizer)`,
        `.verify(vocab_size)`), once, before any request. ValueError naming the option."""
        try:
            params = self._sampling_params(sampling, max(1, sampling.max_new_tokens))
        except EngineError as e:
            raise ValueError(str(e)) from None
        cls = self._sampling_class()
        fields = _sampling_fields(cls) - INTERNAL_SAMPLING_FIELDS
        for key in sorted(set(params) - fields):
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"--sampling-arg {key}: not a sampling parameter of this SGLang{hint}; "
                f"it takes {', '.join(sorted(fields))}"
            )
        preferred = getattr(self._tm, "preferred_sampling_params", None)
        merged = {**preferred, **params} if isinstance(preferred, dict) else params
        model_config = getattr(self._tm, "model_config", None)
        try:
            obj = cls(**merged)
            obj.normalize(self._tok.hf)
            obj.verify(getattr(model_config, "vocab_size", None))
        except Exception as e:  # verify()'s ValueError names the field and the value
            shown = ", ".join(f"{k}={v!r}" for k, v in params.items() if k != "structural_tag")
            raise ValueError(f"SGLang refuses the sampling parameters ({shown}): {e}") from None

    def _sampling_class(self) -> Any:
        """The SamplingParams class SGLang's tokenizer manager builds each request with."""
        cls = getattr(self._tm, "sampling_params_class", None)
        if cls is None:
            try:
                mod = importlib.import_module("sglang.srt.sampling.sampling_params")
                cls = mod.SamplingParams
            except (ImportError, AttributeError) as e:
                raise EngineError(f"cannot find SGLang's SamplingParams ({e})") from None
        return cls

    # ---- requests ----------------------------------------------------------------------

    def _room(self, ids: list[int], sampling: SamplingParams) -> int:
        """max_new_tokens clamped to the context left; refuses what SGLang would refuse."""
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
        return max_new

    async def _request(self, kwargs: dict[str, Any]) -> Any:
        """async_generate. How SGLang fails a request (non-streaming, no HTTP request):
        refusals before the scheduler (`_validate_one_request`, SamplingParams) raise
        ValueError; a scheduler abort with status 400 raises ValueError, with a status up to
        599 `fastapi.HTTPException` (`_handle_abort_finish_reason`); an abort without status
        comes back as a result (`_checked_meta`)."""
        try:
            return await self._engine.async_generate(**kwargs)
        except ValueError as e:  # a bad request: trying again fails the same way
            self._counts["failed"] += 1
            if any(s in str(e).lower() for s in _CONTEXT_ERRORS):
                raise ContextLimitExceeded(str(e)) from None
            raise EngineError(f"SGLang refused the request: {e}") from None
        except (ConnectionError, TimeoutError) as e:
            self._counts["failed"] += 1
            self._counts["transient"] += 1
            raise TransientEngineError(f"SGLang request failed: {type(e).__name__}: {e}") from None
        except Exception as e:  # fastapi.HTTPException for 5xx aborts, ZMQ errors, ...
            status = getattr(e, "status_code", None)
            if isinstance(status, int):
                self._counts["aborted"] += 1
                _raise_abort(status, str(getattr(e, "detail", e)), self._counts)
            self._counts["failed"] += 1
            raise EngineError(f"SGLang request failed: {type(e).__name__}: {e}") from None

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

    # ---- per-agent state ---------------------------------------------------------------

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
        if rank is not None and self._rank_kw is not None:
            opts[self._rank_kw] = rank
        prio = self._priority_of(agent)
        if prio is not None:
            opts["priority"] = prio
        return opts

    def _pick_rank(self) -> int:
        if self._dp_assign == "round_robin":
            return next(self._rr) % self._dp_size
        with contextlib.suppress(Exception):  # a failed read leaves the last usage
            self._loads.read()
        usage = self._loads.rank_usage(self._dp_size)
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

    # ---- results -----------------------------------------------------------------------

    def _generation(
        self, out: Any, ids: list[int], t0: float, rank: int | None, logprobs: bool
    ) -> Generation:
        meta = self._checked_meta(out)
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else fr
        output_ids = [int(t) for t in out.get("output_ids") or []]
        stopped_on_eos = ftype == "stop" and self._ends_on_eos(output_ids, fr)
        host = _host_tokens(meta.get("cached_tokens_details"))
        prompt = int(meta.get("prompt_tokens", len(ids)))
        cached = int(meta.get("cached_tokens") or 0)
        latency = number(meta.get("e2e_latency"))
        got_rank = meta.get("dp_rank")
        if rank is not None and isinstance(got_rank, int) and got_rank != rank:
            self._counts["dp_rank_mismatch"] += 1
        token_logprobs = self._output_logprobs(meta, len(output_ids)) if logprobs else None
        self._count(prompt, cached, host)
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
            output_logprobs=token_logprobs,
        )

    def _checked_meta(self, out: Any) -> dict[str, Any]:
        """meta_info of a finished request; an abort raises (see _raise_abort). Aborts
        come back as results when they carry no status: an AbortReq (`Aborted`, `Abort in
        waiting queue`: tokenizer_manager._handle_abort_req), a pause or a session close."""
        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            self._counts["failed"] += 1
            raise EngineError(f"unexpected SGLang result: {type(out).__name__}")
        meta: dict[str, Any] = out["meta_info"]
        fr = meta.get("finish_reason")
        if (fr.get("type") if isinstance(fr, dict) else fr) == "abort":
            self._counts["aborted"] += 1
            msg = fr.get("message") if isinstance(fr, dict) else None
            status = fr.get("status_code") if isinstance(fr, dict) else None
            _raise_abort(status, str(msg or "no reason given"), self._counts)
        return meta

    def _ends_on_eos(self, output_ids: list[int], fr: Any) -> bool:
        """SGLang keeps the matched stop token in output_ids ("stop position is included");
        it is an end of turn when it is one of the tokenizer's eos ids."""
        matched = fr.get("matched") if isinstance(fr, dict) else None
        matched_ids = {matched} if isinstance(matched, int) else set()
        if isinstance(matched, list):
            matched_ids = {m for m in matched if isinstance(m, int)}
        return (
            bool(output_ids)
            and output_ids[-1] in matched_ids
            and output_ids[-1] in self._tok.eos_ids
        )

    def _output_logprobs(self, meta: dict[str, Any], n_out: int) -> list[float]:
        """meta_info["output_token_logprobs"]: one (logprob, token id, text or None) per
        output token (tokenizer_manager.add_logprob_to_meta_info) -> the logprobs."""
        entries = meta.get("output_token_logprobs")
        try:
            values = [float(e[0]) for e in entries or []]
        except (TypeError, ValueError, IndexError) as e:
            self._counts["failed"] += 1
            raise EngineError(f"unreadable output_token_logprobs from SGLang: {e}") from None
        if len(values) != n_out:
            self._counts["failed"] += 1
            raise EngineError(
                f"SGLang returned {len(values)} output logprobs for {n_out} output tokens"
            )
        return values

    def _count(self, prompt: int, cached: int, host: int) -> None:
        c = self._counts
        c["requests"] += 1
        c["prompt_tokens"] += prompt
        c["cached_tokens"] += cached
        c["cached_host_tokens"] += host

    # ---- signals -----------------------------------------------------------------------

    def _stats(self) -> CacheStats:
        ranks = self._loads.rows()
        values = [u for u in (number(r["token_usage"]) for r in ranks) if u is not None]
        used = [
            int(r["num_used_tokens"]) for r in ranks if number(r["num_used_tokens"]) is not None
        ]
        cap = [
            int(r["max_total_num_tokens"])
            for r in ranks
            if number(r["max_total_num_tokens"]) is not None
        ]
        c = self._counts
        extra: dict[str, Any] = {
            "usage_source": self._loads.source,
            "usage_agg": "max over DP ranks of token_usage",
            "usage_mean": sum(values) / len(values) if values else None,
            "ranks": ranks,
            "rank_usage": self._loads.rank_usage(self._dp_size),
            "dp_size": self._dp_size,
            "agents_per_rank": list(self._rank_agents),
            "loads_age_s": self._loads.age_s(),
            "physical_usage": None,
            "physical_note": _PHYSICAL_NOTE,
            "sessions_open": len(self._session_ids),
            "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else None,
            **c,
        }
        if self._loads.error:
            extra["usage_error"] = self._loads.error
        if self._loads.source != "unavailable" and not ranks:
            extra["usage_note"] = "no load snapshot yet"
        if self._dp_size > 1 and self._rank_kw is None:
            extra["dp_routing"] = "unsupported by this SGLang (no routed_dp_rank)"
        return CacheStats(
            usage=max(values) if values else None,
            capacity_tokens=sum(cap) if cap else None,
            used_tokens=sum(used) if used else None,
            extra=extra,
        )


# ---- construction helpers ---------------------------------------------------------------


def transient_status(status: int) -> bool:
    """Whether an abort with this HTTP status may pass: the server's side (5xx: out of
    memory even after retracting, retracted without a KV backup, a timeout's 503, a failed
    KV load), a time-out (408) or overload (429). Other 4xx are the request's own fault."""
    return status >= 500 or status in (408, 429)


def _raise_abort(status: Any, message: str, counts: dict[str, int]) -> None:
    """An aborted request as the runner's error: context-length refusals as
    ContextLimitExceeded, other bad requests (4xx) as EngineError, everything else
    (5xx, or no status: aborted by a caller, a pause, a retraction) as TransientEngineError."""
    if any(s in message.lower() for s in _CONTEXT_ERRORS):
        raise ContextLimitExceeded(message)
    code = f" ({status})" if isinstance(status, int) else ""
    if isinstance(status, int) and 400 <= status < 500 and not transient_status(status):
        raise EngineError(f"SGLang refused the request{code}: {message}")
    counts["transient"] += 1
    raise TransientEngineError(f"SGLang aborted the request{code}: {message}")


def _check_choices(dp_assign: str, priority: Any) -> None:
    if dp_assign not in DP_ASSIGN:
        raise ValueError(f"dp_assign must be one of {DP_ASSIGN}, got {dp_assign!r}")
    if isinstance(priority, bool) or (isinstance(priority, str) and priority != "fifo"):
        raise ValueError(f"priority must be an int, 'fifo' or a callable, got {priority!r}")


def _checked_sampling_extra(sampling_extra: dict[str, Any] | None) -> dict[str, Any]:
    extra = dict(sampling_extra or {})
    bad = sorted(set(extra) & (OWNED_SAMPLING_KEYS | LOGPROB_KEYS))
    if bad:
        raise ValueError(
            f"sampling extras may not set {bad}: the runner owns them (or they would cap "
            "prefix reuse)"
        )
    return extra


def _opt_in_requirements(sessions: bool, priority: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(server args, environment variables) the opt-ins need on the installed release."""
    args: dict[str, Any] = {}
    env: dict[str, str] = {}
    if sessions:
        args, env = versions.session_requirements(versions.installed_version())
    if priority is not None:
        args["enable_priority_scheduling"] = True
    return args, env


def server_args(
    named: dict[str, Any], opt_in: dict[str, Any], engine_args: dict[str, Any] | None
) -> dict[str, Any]:
    """engine_args plus the named flags (None: not given) and what the opt-ins need; a value
    given twice differently is a ValueError."""
    kwargs: dict[str, Any] = dict(engine_args or {})
    for source, given in (("", named), (" (needed by an opt-in)", opt_in)):
        for key, value in given.items():
            if value is None:
                continue
            if key in kwargs and kwargs[key] != value:
                raise ValueError(
                    f"engine argument {key}={kwargs[key]!r} conflicts with {key}={value!r}" + source
                )
            kwargs[key] = value
    bad = sorted(set(kwargs) & LOGPROB_KEYS)
    if bad:
        raise ValueError(f"{bad} are request options, not server arguments")
    return kwargs


def _import_engine() -> Callable[..., Any]:
    """sglang.Engine, imported only now: sglang is absent on CPU machines, slow to import,
    and sets uvloop as the event loop policy."""
    try:
        sglang = importlib.import_module("sglang")
    except ImportError as e:
        raise EngineError(f"the SGLang engine needs sglang: {INSTALL_HINT} ({e})") from None
    factory = getattr(sglang, "Engine", None)
    if factory is None:
        raise EngineError(f"this sglang has no sglang.Engine; {INSTALL_HINT}")
    return factory


def _start(factory: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise EngineError(f"SGLang rejected the server arguments: {e}") from e
    except EngineError:
        raise
    except Exception as e:
        raise EngineError(f"SGLang failed to start: {type(e).__name__}: {e}") from e


def _generate_params(eng: Any) -> set[str] | None:
    """Keyword names async_generate takes, or None when it takes **kwargs / is opaque."""
    try:
        sig = inspect.signature(eng.async_generate)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return set(sig.parameters)


def _sampling_fields(cls: Any) -> set[str]:
    """Field names of SGLang's SamplingParams: a msgspec Struct's `__struct_fields__`
    (0.5.16 and later at least), else its constructor's keywords (a plain class in 0.5.9)."""
    names = getattr(cls, "__struct_fields__", None)
    if names is not None:
        return set(names)
    params = inspect.signature(cls).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _host_tokens(details: Any) -> int:
    """Prompt tokens reloaded from host memory or storage (HiCache); 0 otherwise."""
    if not isinstance(details, dict):
        return 0
    return int(details.get("host") or 0) + int(details.get("storage") or 0)
