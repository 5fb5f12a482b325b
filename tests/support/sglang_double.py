"""A TEST DOUBLE of the SGLang surface runner/engines/sglang/ uses. Not SGLang.

`install_fake_sglang(monkeypatch)` puts a fake `sglang` package (with `sglang.Engine` and
`sglang.srt.managers.io_struct`) into sys.modules, so the adapter runs its real import path
unchanged. What it reproduces, from SGLang's source (see docs/sglang.md for the files):

- `Engine(**server_args)`: unknown server args raise TypeError (ServerArgs is a msgspec
  Struct since 0.5.20, a dataclass before); `.server_args`, `.tokenizer_manager`,
  `.shutdown()`.
- `await Engine.async_generate(input_ids=..., sampling_params=..., routed_dp_rank=...,
  priority=..., session_id=..., ...)` -> `{"text", "output_ids", "meta_info"}` with
  meta_info keys id, finish_reason ({"type": "stop", "matched": token id or stop string} |
  {"type": "length", "length": n} | {"type": "abort", "message": ...}), prompt_tokens,
  completion_tokens, cached_tokens, cached_tokens_details ({"device", "host"} whenever
  something hit; host > 0 only with enable_hierarchical_cache), dp_rank (dp_size > 1),
  e2e_latency; with return_logprob also input_token_logprobs (empty: logprobs start at the
  output) and output_token_logprobs, one (logprob, token id, None) per output token. The
  matched stop token stays in output_ids. Sampling params go through
  `tokenizer_manager.sampling_params_class` (FakeSamplingParams: only SAMPLING_KEYS, any other
  key a TypeError as msgspec raises; normalize(); verify() with SGLang's range checks and
  messages), as TokenizerManager._create_tokenized_object does. The context checks of
  TokenizerManager._validate_one_request raise ValueError. Aborts (`Abort`): without a status
  a result with finish_reason abort (an AbortReq); with 400 a ValueError, with 401-599 an
  HTTPException (the double of fastapi's), as _handle_abort_finish_reason raises them. A tiny
  radix cache gives cached_tokens (match capped at len - 1).

tests/contract/test_sglang_source.py checks every name the double accepts or returns against the
released sglang wheel.
- `tokenizer_manager`: `.tokenizer` (a tiny HF-like tokenizer, below), `.context_len`,
  `.max_req_input_len`, `.model_config.hf_eos_token_id` / `.vocab_size`, `.server_args`,
  `.sampling_params_class`,
  `.load_snapshot_reader.read_all()` (per-rank snapshot objects with token_usage etc.;
  absent with `legacy_loads=True`, as on older releases), `await .get_loads()`,
  `await .open_session(obj, None)`, `await .close_session(obj, None)`.
- The synchronous Engine helpers (generate, get_server_info, flush_cache, open_session,
  close_session, ...) raise, like `loop.run_until_complete`, when called while an event loop
  runs; every call is recorded in `engine.sync_calls`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

# ---- a tiny deterministic HF-like tokenizer ---------------------------------------------

SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<s>": 3}
SPECIAL_TEXT = {v: k for k, v in SPECIALS.items()}
BOS_ID, EOT_ID, EOS_ID = 3, 2, 0
CHAR_OFFSET = 100  # every other character c is the token 100 + ord(c)
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_WITH_TOOLS = "{% if tools %}# Tools: {{ tools | tojson }}{% endif %}" + CHATML


class TinyTokenizer:
    """Character-level, with ChatML special tokens; the HF calls the adapter makes."""

    eos_token = "<|endoftext|>"
    eos_token_id = EOS_ID
    bos_token_id = BOS_ID
    unk_token_id = None
    is_fast = True

    def __init__(self, tools_in_template: bool = False) -> None:
        self.chat_template = CHATML_WITH_TOOLS if tools_in_template else CHATML
        self.template_calls: list[dict[str, Any]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        for piece in _SPECIAL_RE.split(text):
            if piece in SPECIALS:
                ids.append(SPECIALS[piece])
            else:
                ids.extend(CHAR_OFFSET + ord(c) for c in piece)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        out = []
        for t in ids:
            if t in SPECIAL_TEXT:
                if not skip_special_tokens:
                    out.append(SPECIAL_TEXT[t])
            else:
                out.append(chr(t - CHAR_OFFSET))
        return "".join(out)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return SPECIALS.get(token, self.unk_token_id)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        self.template_calls.append(
            {"tools": tools, "tokenize": tokenize, "add_generation_prompt": add_generation_prompt}
        )
        assert tokenize is False, "the double only renders text"
        text = ""
        if tools and "tools" in self.chat_template:
            text += "# Tools: " + json.dumps(tools)
        for m in conversation:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text


# ---- the engine -------------------------------------------------------------------------

KNOWN_SERVER_ARGS = frozenset(
    {
        "model_path",
        "tp_size",
        "dp_size",
        "mem_fraction_static",
        "context_length",
        "max_total_tokens",
        "page_size",
        "chunked_prefill_size",
        "max_running_requests",
        "schedule_policy",
        "disable_radix_cache",
        "radix_eviction_policy",
        "enable_session_radix_cache",
        "enable_priority_scheduling",
        "schedule_low_priority_values_first",
        "enable_hierarchical_cache",
        "hicache_ratio",
        "hicache_size",
        "hicache_write_policy",
        "enable_metrics",
        "load_balance_method",
        "skip_tokenizer_init",
        "log_level",
        "random_seed",
    }
)


# The SamplingParams fields the double takes: a subset of SGLang's API fields
# (srt/sampling/sampling_params.py), so a key the real engine rejects fails here too.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "sampling_seed",
    }
)


# SamplingParams.verify's range checks (srt/sampling/sampling_params.py), with the start of
# each message as SGLang words it: field -> (accepts the value, message start).
VERIFY_CHECKS: dict[str, tuple[Any, str]] = {
    "temperature": (lambda v: v == v and v >= 0.0, "temperature must be a non-negative finite"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "top_p must be in (0, 1], got"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "min_p must be in [0, 1], got"),
    "top_k": (lambda v: v == -1 or v >= 1, "top_k must be -1 (disable) or at least 1, got"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "frequency_penalty must be in [-2, 2], got"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "presence_penalty must be in [-2, 2], got"),
    "repetition_penalty": (lambda v: 0.0 < v <= 2.0, "repetition_penalty must be in (0, 2]"),
    "min_new_tokens": (lambda v: v >= 0, "min_new_tokens must be in [0, max_new_tokens], got"),
    "max_new_tokens": (lambda v: v >= 0, "max_new_tokens must be at least 0, got"),
}
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")
MIN_NEW_ABOVE_MAX = "min_new_tokens must be in [0, max_new_tokens"


class FakeSamplingParams:
    """The double of SGLang's SamplingParams (a msgspec Struct): keyword fields only
    (SAMPLING_KEYS; any other raises TypeError as msgspec does), `normalize(tokenizer)`,
    `verify(vocab_size)` with SGLang's range checks and its one-grammar rule."""

    __struct_fields__ = tuple(sorted(SAMPLING_KEYS))

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - SAMPLING_KEYS)
        if unknown:  # msgspec's message for SamplingParams(**sp)
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        self.values = kwargs
        self.normalized = False

    def normalize(self, tokenizer: Any) -> None:
        self.normalized = True

    def verify(self, vocab_size: int) -> None:
        for key, (ok, message) in VERIFY_CHECKS.items():
            value = self.values.get(key)
            if value is not None and not ok(value):
                raise ValueError(f"{message} {value}.")
        low, high = self.values.get("min_new_tokens") or 0, self.values.get("max_new_tokens")
        if high is not None and not low <= high:
            raise ValueError(f"{MIN_NEW_ABOVE_MAX}({high})], got {low}.")
        if sum(self.values.get(g) is not None for g in GRAMMARS) > 1:
            raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


class HTTPException(Exception):
    """The double of fastapi.HTTPException (status_code, detail), which SGLang's tokenizer
    manager raises for an abort with a 5xx status."""

    def __init__(self, status_code: int, detail: Any = None) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


def fake_logprob(token_id: int) -> float:
    """The double's deterministic log-probability of an output token."""
    return -((token_id % 7) + 1) / 8


@dataclass
class FakeLoad:
    """Shaped like SGLang's LoadSnapshot (a msgspec Struct: attributes, not keys)."""

    dp_rank: int = 0
    timestamp: float = 0.0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    max_total_num_tokens: int = 1000
    token_usage: float = 0.0


class FakeReader:
    def __init__(self, snapshots: list[FakeLoad]) -> None:
        self.snapshots = snapshots
        self.reads = 0

    def read_all(self) -> list[FakeLoad]:
        self.reads += 1
        return list(self.snapshots)


@dataclass
class OpenSessionReqInput:
    capacity_of_str_len: int
    session_id: str | None = None
    streaming: bool | None = None
    timeout: float | None = None


@dataclass
class CloseSessionReqInput:
    session_id: str


@dataclass
class Abort:
    """A scripted reply that SGLang aborts. Without a status: an AbortReq, returned as a
    result (TokenizerManager._handle_abort_req). With one, a scheduler's FINISH_ABORT,
    raised by _handle_abort_finish_reason: 400 as ValueError, up to 599 as HTTPException."""

    message: str = "Abort in waiting queue"
    status_code: int | None = None
    returned: bool = False  # a status comes back in the result (0.5.9: other than 400/500/503)


@dataclass
class Reply:
    """A scripted reply: text, then the end-of-turn token unless `eos` is None."""

    text: str
    eos: int | None = EOT_ID


class FakeTokenizerManager:
    def __init__(self, engine: FakeSGLangEngine, cfg: dict[str, Any]) -> None:
        sa = engine.server_args
        self.server_args = sa
        self.tokenizer = TinyTokenizer(cfg.get("tools_in_template", False))
        self.context_len = cfg.get("context_len", 4096)
        self.max_req_input_len = self.context_len - 1
        self.model_config = SimpleNamespace(
            hf_eos_token_id={EOS_ID},
            context_len=self.context_len,
            vocab_size=CHAR_OFFSET + 0x110000,
        )
        self.sampling_params_class = FakeSamplingParams
        self.served_model_name = sa.model_path
        self.events = engine.events
        self.snapshots = [FakeLoad(dp_rank=r) for r in range(sa.dp_size)]
        if not cfg.get("legacy_loads", False):
            self.load_snapshot_reader = FakeReader(self.snapshots)
        self.get_loads_calls = 0
        self.opened: list[str] = []
        self.closed: list[str] = []

    async def get_loads(self, include: Any = None, dp_rank: int | None = None) -> list[FakeLoad]:
        self.get_loads_calls += 1
        await asyncio.sleep(0)
        return list(self.snapshots)

    async def open_session(self, obj: OpenSessionReqInput, request: Any = None) -> str | None:
        self.opened.append(obj.session_id)
        self.events.append(("open_session", obj.session_id))
        return obj.session_id

    async def close_session(self, obj: CloseSessionReqInput, request: Any = None) -> None:
        self.closed.append(obj.session_id)
        self.events.append(("close_session", obj.session_id))


class FakeSGLangEngine:
    """The double of sglang.Engine. `config` knobs: context_len, legacy_loads,
    tools_in_template, replies (list of str | Reply | Abort | Exception), host_fraction."""

    config: ClassVar[dict[str, Any]] = {}
    instances: ClassVar[list[FakeSGLangEngine]] = []

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - KNOWN_SERVER_ARGS)
        if unknown:
            raise TypeError(
                f"ServerArgs.__init__() got an unexpected keyword argument {unknown[0]!r}"
            )
        cfg = dict(self.config)
        defaults = {k: None for k in KNOWN_SERVER_ARGS}
        defaults.update(
            tp_size=1,
            dp_size=1,
            enable_session_radix_cache=False,
            enable_priority_scheduling=False,
            schedule_low_priority_values_first=False,
            enable_hierarchical_cache=False,
            skip_tokenizer_init=False,
            log_level="error",
        )
        defaults.update(kwargs)
        self.server_args = SimpleNamespace(**defaults)
        self.kwargs = kwargs
        self.events: list[tuple[Any, ...]] = []
        self.calls: list[dict[str, Any]] = []
        self.sync_calls: list[str] = []
        self.shutdown_calls = 0
        self.replies: list[Any] = list(cfg.get("replies", []))
        self.host_fraction: float = cfg.get("host_fraction", 0.0)
        self.tokenizer_manager = FakeTokenizerManager(self, cfg)
        if self.server_args.skip_tokenizer_init:
            self.tokenizer_manager.tokenizer = None
        self._radix: dict[int, list[tuple[int, ...]]] = {}
        self._rr = 0
        self._rid = 0
        type(self).instances.append(self)

    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        image_data: Any = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        token_ids_logprob: Any = None,
        lora_path: Any = None,
        custom_logit_processor: Any = None,
        stream: bool = False,
        routed_dp_rank: int | None = None,
        data_parallel_rank: int | None = None,
        rid: str | None = None,
        session_params: dict | None = None,
        priority: int | None = None,
        session_id: str | None = None,
        *,
        cache_salt: Any = None,
    ) -> dict[str, Any]:
        args = {k: v for k, v in locals().items() if k != "self"}
        args["input_ids"] = list(input_ids) if input_ids is not None else None
        self.calls.append(args)
        self.events.append(("generate", session_id))
        sp = dict(sampling_params or {})
        tm = self.tokenizer_manager
        params = tm.sampling_params_class(**sp)  # as _create_tokenized_object does
        params.normalize(tm.tokenizer)
        params.verify(tm.model_config.vocab_size)
        if sp.get("structural_tag"):  # xgrammar compiles the "format" form; others fail
            tag = json.loads(sp["structural_tag"])
            if tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
                raise ValueError(f"Hit invalid structural_tag: {sp['structural_tag']!r}")
        ids = list(input_ids or [])
        dp = self.server_args.dp_size
        ignored = dp <= 1 and routed_dp_rank == 0  # SGLang ignores rank 0 without DP
        if routed_dp_rank is not None and not ignored and not 0 <= routed_dp_rank < dp:
            raise ValueError(f"routed_dp_rank={routed_dp_rank} out of range [0, {dp})")
        if len(ids) >= tm.context_len:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({tm.context_len} tokens)."
            )
        max_new = sp.get("max_new_tokens", 128)
        if max_new + len(ids) > tm.context_len:
            raise ValueError(
                "Requested token count exceeds the model's maximum context length of "
                f"{tm.context_len} tokens."
            )
        await asyncio.sleep(0)
        self._rid += 1
        rid = rid or f"rid-{self._rid}"
        reply = self.replies.pop(0) if self.replies else Reply("ok")
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, Abort) and reply.status_code is not None and not reply.returned:
            if reply.status_code == 400:  # _handle_abort_finish_reason
                raise ValueError(reply.message)
            if 400 < reply.status_code < 600:
                raise HTTPException(status_code=reply.status_code, detail=reply.message)
        if isinstance(reply, Abort):
            return {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": "abort", "message": reply.message}
                    | ({"status_code": reply.status_code} if reply.returned else {}),
                    "e2e_latency": 0.01,
                    "completion_tokens": 0,
                },
            }
        if isinstance(reply, str):
            reply = Reply(reply)
        tok = tm.tokenizer
        text = reply.text
        finish: dict[str, Any] | None = None
        for stop in sp.get("stop") or []:
            pos = text.find(stop)
            if pos != -1:
                text = text[: pos + len(stop)]  # the stop string stays in output_ids
                finish = {"type": "stop", "matched": stop}
                break
        out = tok.encode(text, add_special_tokens=False)
        if finish is None and reply.eos is not None:
            out.append(reply.eos)
            stops = set(sp.get("stop_token_ids") or []) | tm.model_config.hf_eos_token_id
            if reply.eos in stops:
                finish = {"type": "stop", "matched": reply.eos}
        if len(out) > max_new:
            out = out[:max_new]
            finish = {"type": "length", "length": max_new}
        finish = finish or {"type": "length", "length": len(out)}
        rank = routed_dp_rank if routed_dp_rank is not None else data_parallel_rank
        if rank is None:
            rank, self._rr = self._rr % dp, self._rr + 1
        cached = self._match(rank, ids)
        self._radix.setdefault(rank, []).append(tuple(ids + out))
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(out),
            "cached_tokens": cached,
        }
        if cached > 0:  # output_streamer.get_cached_tokens_details
            hicache = self.server_args.enable_hierarchical_cache
            host = int(cached * self.host_fraction) if hicache else 0
            meta["cached_tokens_details"] = {"device": cached - host, "host": host}
        if return_logprob:  # tokenizer_manager.add_logprob_to_meta_info
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [(fake_logprob(t), t, None) for t in out]
            meta["output_token_logprobs_length"] = len(out)
        if dp > 1:
            meta["dp_rank"] = rank
        meta["e2e_latency"] = 0.05
        matched = finish.get("matched")
        shown = tok.decode(out, skip_special_tokens=True)
        if isinstance(matched, str):  # SGLang trims a matched stop string from the text only
            shown = shown[: shown.find(matched)] if matched in shown else shown
        return {
            "text": shown,
            "output_ids": out,
            "meta_info": meta,
        }

    def _match(self, rank: int, ids: list[int]) -> int:
        best = 0
        for seq in self._radix.get(rank, []):
            n = 0
            for a, b in zip(seq, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, max(0, len(ids) - 1))  # SGLang recomputes at least one token

    # ---- synchronous helpers: they call loop.run_until_complete in SGLang ----------------

    def _sync(self, name: str) -> None:
        self.sync_calls.append(name)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise RuntimeError(f"Engine.{name}: this event loop is already running")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._sync("generate")

    def get_server_info(self) -> Any:
        self._sync("get_server_info")

    def flush_cache(self) -> Any:
        self._sync("flush_cache")

    def open_session(self, *args: Any, **kwargs: Any) -> Any:
        self._sync("open_session")

    def close_session(self, *args: Any, **kwargs: Any) -> Any:
        self._sync("close_session")

    def get_model_info(self) -> Any:
        self._sync("get_model_info")

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        self.events.append(("shutdown",))


@dataclass
class FakeSGLang:
    """What install_fake_sglang returns: the fake package and the engines it made."""

    module: types.ModuleType
    engine_class: type[FakeSGLangEngine]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def engines(self) -> list[FakeSGLangEngine]:
        return self.engine_class.instances

    @property
    def engine(self) -> FakeSGLangEngine:
        return self.engine_class.instances[-1]


def install_fake_sglang(monkeypatch: Any, **config: Any) -> FakeSGLang:
    """Put the fake `sglang` package into sys.modules for one test."""
    engine_class = type("Engine", (FakeSGLangEngine,), {"config": dict(config), "instances": []})
    pkg = types.ModuleType("sglang")
    pkg.__path__ = []  # a package, so its submodules import
    pkg.Engine = engine_class
    srt = types.ModuleType("sglang.srt")
    srt.__path__ = []
    managers = types.ModuleType("sglang.srt.managers")
    managers.__path__ = []
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.OpenSessionReqInput = OpenSessionReqInput
    io_struct.CloseSessionReqInput = CloseSessionReqInput
    pkg.srt, srt.managers, managers.io_struct = srt, managers, io_struct
    for name, mod in (
        ("sglang", pkg),
        ("sglang.srt", srt),
        ("sglang.srt.managers", managers),
        ("sglang.srt.managers.io_struct", io_struct),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return FakeSGLang(pkg, engine_class, dict(config))
