"""The engine protocol: the one small interface every LLM engine implements, and the
capability protocols some engines add.

An engine takes token ids and returns token ids (token in, token out), reports per-request
cache use, and on demand the occupancy of its KV pool. The agent loop, the gate and the
store only ever see these types; engines never import the rest of the runner.

Capabilities (`DataParallel`, `ConstrainedDecoding`, `TokenLogprobs`, `SamplingCheck`,
`EngineStats`) are protocols too: the
runner asks `isinstance(engine, DataParallel)`, never `getattr`, never an engine's name or
concrete class. An engine gains a capability by implementing its members.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    seed: int = 0
    # JSON schema (as text) of the object inside <tool_call>...</tool_call>: engines that can
    # constrain decoding make the reply exactly one such call; others ignore it.
    tool_call_schema: str | None = None
    # Ask for the log-probability of every generated token (engines with TokenLogprobs).
    logprobs: bool = False


@dataclass(frozen=True)
class Generation:
    """One finished request, with the engine's own accounting."""

    output_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (device + host)
    completion_tokens: int
    finish_reason: str  # "stop" | "length"
    seconds: float
    cached_host_tokens: int = 0  # the part of cached_tokens reloaded from host memory
    stopped_on_eos: bool = False  # output_ids end with the end-of-turn token
    # one per output id when SamplingParams.logprobs was set and the engine gives them
    output_logprobs: list[float] | None = None


@dataclass(frozen=True)
class CacheStats:
    """The engine's cache signals at one instant.

    usage: fraction of the KV pool held, as the engine defines it (SGLang: tokens of running
    requests and locked prefixes; llama.cpp: bytes of cached states / capacity). None when the
    engine cannot tell.
    """

    usage: float | None
    capacity_tokens: int | None = None
    used_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # A host-memory KV tier (HiCache): its size, and what reloading one token from it costs
    # relative to recomputing it (below 1: cheaper). None where there is none or it is unknown.
    host_capacity_tokens: int | None = None
    host_reload_cost: float | None = None
    # Seconds the engine takes to prefill (recompute) one token of context; None if unknown.
    recompute_token_seconds: float | None = None
    # The most agents' contexts the engine keeps at once where that is fewer than its tokens
    # allow (llama.cpp: its sequence slots, one stream each); None: only tokens limit it.
    resident_limit: int | None = None
    # Whether a prefix common to several contexts is stored once (a radix cache: SGLang, the
    # simulator); False where each context holds its own copy (llama.cpp copies it per stream).
    shares_prefixes: bool = True
    # Seconds of host-to-device link time to reload one token from the host tier (each GPU
    # its share, in parallel); None where there is no host tier or it is unknown.
    host_reload_token_seconds: float | None = None


class EngineError(RuntimeError):
    """A request failed inside the engine; the agent that sent it fails, the batch goes on."""


class TransientEngineError(EngineError):
    """A failure that may not recur: a timeout, an aborted or retracted request, an
    out-of-memory abort, a lost connection. Retried with backoff (runner/agent/retries.py)."""


class ContextLimitExceeded(EngineError):
    """The prompt plus the requested output do not fit the engine's context window."""


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """Tokens of text, special tokens parsed, no BOS added."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens left out."""
        ...

    def token_text(self, token_id: int) -> str:
        """Text of one token, special tokens included (e.g. "<|im_end|>")."""
        ...

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template applied to messages (with tool schemas when the template takes
        them), as text including special tokens and any BOS the template writes."""
        ...

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool schemas itself."""
        ...

    @property
    def eos_ids(self) -> frozenset[int]: ...


@runtime_checkable
class Engine(Protocol):
    name: str
    model: str
    context_limit: int  # max prompt + output tokens per request

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, agent: str | None = None
    ) -> Generation:
        """One request. `agent` names the agent sending it, for engines that keep per-agent
        state (SGLang sessions, sticky data-parallel ranks); others ignore it."""
        ...

    async def end_agent(self, agent: str) -> None:
        """The agent ended (any status): release what the engine keeps for it. Idempotent."""
        ...

    def cache_stats(self) -> CacheStats:
        """Cheap, non-blocking read of the cache signals (called every control period)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class DataParallel(Protocol):
    """Several data-parallel ranks, each with its own KV pool and prefix cache (SGLang
    `--dp-size`). The batch gives each rank its own gate window (runner/gate/ranked_gate.py) and
    sticks each agent to one rank."""

    @property
    def dp_size(self) -> int:
        """Number of ranks (1: behaves as a single engine)."""
        ...

    def assign_rank(self, agent: str, rank: int | None = None) -> int | None:
        """Pin `agent` to `rank` (None: the engine picks). Returns the rank."""
        ...

    def rank_stats(self, rank: int) -> CacheStats:
        """cache_stats() of one rank."""
        ...


@runtime_checkable
class ConstrainedDecoding(Protocol):
    """The engine honours SamplingParams.tool_call_schema: every reply is then exactly one
    well-formed tool call."""

    @property
    def constrain_by_default(self) -> bool:
        """Whether `--constrain-tool-calls auto` turns it on for this engine (on where small
        models need it; off where it would forbid a reasoning model's <think> block)."""
        ...


@runtime_checkable
class TokenLogprobs(Protocol):
    """The engine fills Generation.output_logprobs when SamplingParams.logprobs is set."""

    @property
    def gives_logprobs(self) -> bool:
        """False where this instance cannot (e.g. a build without the option)."""
        ...


@runtime_checkable
class SamplingCheck(Protocol):
    """The engine checks sampling parameters against what it accepts, once, before any
    request: the runner calls it at start-up with the run's sampling and each task's
    overrides, so a bad option is one error naming it, not a failure of every request."""

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise ValueError naming the option the engine would refuse in a request with
        `sampling` (the engine's own extra options included)."""
        ...


@runtime_checkable
class EngineStats(Protocol):
    """The engine keeps counters over its life (the simulator's accounting); they go to
    summary.json under engine.stats."""

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class TaskScripted(Protocol):
    """The engine's replies come from the tasks themselves (replay). An engine built before
    its tasks are known (a worker of a batch over many nodes) is told of each task that
    arrives, before its agent starts."""

    def add_tasks(self, tasks: Sequence[Any]) -> None: ...
