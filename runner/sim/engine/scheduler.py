"""SimEngine: an SGLang-like engine simulated on the event loop's clock.

It implements the Engine protocol (runner/engines/protocol.py). Requests go through a model of
SGLang's scheduler (managers/scheduler.py, schedule_policy.py, schedule_batch.py, read
from the 0.5.x sources):
- a radix prefix cache over a KV pool of fixed size (radix.py), LRU eviction of unlocked
  leaves, an optional host tier (HiCache);
- continuous batching, prefill first: each iteration either runs a prefill (extend) batch
  if one can be formed, or decodes one token for every running request (SGLang's default,
  no mixed chunks);
- admission (PrefillAdder): FCFS, a request is admitted when its uncached tokens plus an
  estimate of its output fit in free + evictable memory minus the output estimates of
  the running requests (scaled by new_token_ratio); chunked prefill (one request at a time
  is chunked, at most chunked_prefill_size tokens per iteration);
- retraction: when decode cannot get a token per request, requests are preempted
  (fewest generated tokens first, then longest prompt), their KV freed, and they are
  requeued; they recompute prompt + generated-so-far when readmitted;
- each iteration's duration comes from the roofline cost model (cost.py) and is spent with
  `asyncio.sleep`, which on runner.sim.vclock's loop jumps virtual time.

Decode fast-forward: when nothing else can change, k decode iterations are simulated in one
step (one sleep): k is bounded by the fewest tokens any running request still has to
generate (a finish ends the block), by the memory that can be had without retracting, by
`fast_forward_cap`, and by the event loop's next timer (`VirtualClock.next_timer` of
runner.sim.vclock's loop): the block ends with the iteration during which that timer fires,
so a tool returning mid-block is served exactly as SGLang would serve it, after the
iteration in flight. Requests that come from work woken by the engine itself (a future it
resolved) are flushed in before a block is planned (`VirtualClock.has_ready_callbacks`).
When requests wait for admission (and the batch is not marked full), k = 1, since admission
is re-tried every iteration. On an event loop without `VirtualClock` (plain asyncio) the
engine still serves every request correctly, but blocks are not cut at the next timer (a
tool returning mid-block waits for the block's end) and only one pass of ready callbacks
runs before planning.

Accounting (stats()): a shadow radix tree with no capacity records every token sequence
whose KV was ever computed; prefill tokens that the shadow has but the device and host
caches no longer have are "recomputed" tokens, the rest are new.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ...engines.protocol import (
    CacheStats,
    ContextLimitExceeded,
    EngineError,
    Generation,
    SamplingParams,
)
from ...engines.protocol import Tokenizer as TokenizerProto
from ..vclock import VirtualClock
from .cost import CostModel, Deployment
from .radix import EvictionPolicy, Key, Node, RadixCache, WritePolicy

# SGLang's defaults (srt/environ.py, global_config.py)
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
LOAD_BACK_THRESHOLD = 10  # HiRadixCache.load_back_threshold: shorter host hits are misses
LPM_MAX_QUEUE = 128  # SchedulePolicy falls back to FCFS above this queue length

SchedulePolicy = Literal["fcfs", "lpm"]


@dataclass(eq=False)
class _Req:
    rid: int
    prompt: Key
    output: Key  # the exact output ids (already cut at EOS / max_new_tokens)
    max_new: int  # sampling.max_new_tokens (SGLang's estimates use it, not len(output))
    finish_reason: str
    stopped_on_eos: bool
    priority: int
    fut: asyncio.Future[Generation]
    t_arrival: float
    agent: str | None = None
    out_len: int = 0  # output tokens produced so far
    # this admission
    fill: Key = ()  # prompt + output[:out_len] at admission
    fill_len: int = 0
    node: Node | None = None  # locked tree node ending the cached prefix
    prefix: int = 0  # tokens of fill held by the tree (locked through `node`)
    done: int = 0  # tokens of fill whose KV exists (prefix + computed chunks)
    private: int = 0  # KV tokens allocated to this request and not in the tree
    shadow_node: Node | None = None  # shadow tree node ending the computed-before prefix
    shadow_len: int = 0
    # accounting
    cached: int | None = None  # hits at first admission (device + host)
    cached_host: int = 0
    recomputed: int = 0
    retractions: int = 0
    cancelled: bool = False


@dataclass
class _Chunk:
    req: _Req
    start: int
    end: int
    recompute: int


@dataclass(frozen=True)
class RequestRecord:
    """Per-request accounting handed to the optional `on_finish` hook."""

    rid: int
    agent: str | None
    prompt_tokens: int
    cached_tokens: int
    cached_host_tokens: int
    recomputed_tokens: int
    completion_tokens: int
    retractions: int
    arrival: float
    finish: float


@dataclass
class AgentStats:
    """Cumulative accounting of one agent's requests (`agent_stats()`)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_hit_tokens: int = 0
    recomputed_tokens: int = 0  # prefill tokens computed again after eviction/retraction
    completion_tokens: int = 0
    retractions: int = 0
    engine_seconds: float = 0.0  # arrival to finish, summed over its requests


@dataclass
class _Stats:
    iterations: int = 0
    prefill_iterations: int = 0
    decode_iterations: int = 0
    decode_blocks: int = 0  # sleeps that covered decode_iterations (fast-forward)
    seconds_prefill_new: float = 0.0
    seconds_prefill_recompute: float = 0.0
    seconds_decode: float = 0.0
    seconds_host_load: float = 0.0
    seconds_busy: float = 0.0
    seconds_idle: float = 0.0
    tokens_prefill_new: int = 0
    tokens_prefill_recompute: int = 0
    tokens_decode: int = 0
    tokens_host_load: int = 0
    requests: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # first admission, as reported in Generation.cached_tokens
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    readmit_cached_tokens: int = 0  # prefix hits of retracted requests when readmitted
    retractions: int = 0
    retracted_tokens: int = 0  # KV freed by retraction
    max_running: int = 0
    # the pool's token-seconds by what holds them (their sum is capacity x elapsed time):
    # KV locked by requests during decode / prefill iterations, cached but unlocked
    # (evictable), and free
    kv_token_seconds_decoding: float = 0.0
    kv_token_seconds_prefilling: float = 0.0
    kv_token_seconds_cached: float = 0.0
    kv_token_seconds_free: float = 0.0


class SimEngine:
    """The simulated SGLang engine. See the module docstring and docs/simulator.md."""

    name = "sim"

    def __init__(
        self,
        deployment: Deployment,
        tokenizer: TokenizerProto,
        model: Callable[[list[int]], list[int]],
        *,
        hicache_tokens: int = 0,
        hicache_write_policy: WritePolicy = "write_through",
        pcie_bytes_per_s: float | None = None,
        chunked_prefill_size: int = 8192,
        max_prefill_tokens: int = 16384,
        max_running_requests: int | None = None,
        schedule_policy: SchedulePolicy = "fcfs",
        eviction_policy: EvictionPolicy = "lru",
        schedule_conservativeness: float = 1.0,
        fast_forward_cap: int = 64,
        stats_refresh_decode_steps: int = 15,
        priority: int | str | Callable[[str], int | None] | None = None,
        sessions: bool = False,
        on_finish: Callable[[Key, RequestRecord], None] | None = None,
    ) -> None:
        if schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"unknown schedule_policy {schedule_policy!r} (fcfs, lpm)")
        if chunked_prefill_size < 1 or max_prefill_tokens < 1 or fast_forward_cap < 1:
            raise ValueError("chunked_prefill_size, max_prefill_tokens, fast_forward_cap >= 1")
        if isinstance(priority, bool) or (isinstance(priority, str) and priority != "fifo"):
            raise ValueError(f"priority must be an int, 'fifo' or a callable, got {priority!r}")
        self.deployment = deployment
        self.model = deployment.name
        self.context_limit = deployment.max_context
        self.capacity = deployment.pool_tokens
        self.cost = CostModel(deployment, pcie_bytes_per_s)
        self._tok = tokenizer
        self._eos = tokenizer.eos_ids
        self._model_fn = model
        self.hicache_tokens = max(0, int(hicache_tokens))
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens
        # a full chunk prefilled from position 0, per token: what recomputing a context costs
        chunk = max(1, chunked_prefill_size)
        self._recompute_token_seconds = self.cost.prefill([(0, chunk)]).seconds / chunk
        # SGLang model_runner: req_to_token_pool size when --max-running-requests is unset
        default_reqs = min(max(int(self.capacity / self.context_limit * 512), 2048), 4096)
        self.max_running_requests = max_running_requests or default_reqs
        self.schedule_policy = schedule_policy
        self.fast_forward_cap = fast_forward_cap
        self.stats_refresh_decode_steps = stats_refresh_decode_steps
        self.priority = priority
        # SGLang's session radix cache, as the adapter's sessions=True uses it: one session
        # per agent, referencing the leaf of its latest finished request, closed by end_agent
        self.sessions = sessions
        self._session_leaf: dict[str, Node] = {}
        self.on_finish = on_finish
        self._agents: dict[str, AgentStats] = {}
        self._first_seen: dict[str, int] = {}  # "fifo" priority

        self.tree = RadixCache(
            host_capacity=self.hicache_tokens,
            eviction_policy=eviction_policy,
            write_policy=hicache_write_policy,
        )
        self.shadow = RadixCache(track_eviction=False)  # every KV ever computed
        self._private = 0  # KV tokens held by requests outside the tree

        self._ratio_init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self._ratio_min = min(self._ratio_init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self._ratio_decay = (self._ratio_init - self._ratio_min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._ratio = self._ratio_init

        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._chunked: _Req | None = None
        self._batch_is_full = False
        self._n_cancelled = 0
        self._rid = 0
        self._decode_steps = 0
        self._st = _Stats()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock: VirtualClock | None = None  # the loop, when it is a virtual clock
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._snapshot = self._read_cache()

    # ---- Engine protocol -----------------------------------------------------------

    @property
    def tokenizer(self) -> TokenizerProto:
        return self._tok

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        agent: str | None = None,
        priority: int | None = None,
    ) -> Generation:
        """Run one request to completion on the simulated engine. `agent` keys the per-agent
        accounting and the engine-level `priority` option; `priority` overrides it for this
        request. Priority only matters with eviction_policy="priority" (a cache node keeps
        the highest priority of the requests that inserted it); SGLang's priority
        scheduling (queue order, preemption) is not modelled."""
        if self._closed:
            raise EngineError("the simulated engine is shut down")
        if self._error is not None:
            raise EngineError(f"the simulated engine failed: {self._error!r}")
        prompt = tuple(input_ids)  # tuples: see radix.Key
        n, max_new = len(prompt), sampling.max_new_tokens
        if n == 0:
            raise EngineError("empty prompt")
        if max_new < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new}")
        # SGLang tokenizer_manager._validate_one_request
        if n >= self.context_limit or n + max_new >= self.context_limit:
            raise ContextLimitExceeded(
                f"prompt of {n} tokens + max_new_tokens {max_new} does not fit the "
                f"{self.context_limit}-token context of {self.model}"
            )
        # SGLang scheduler: max_req_len = min(context_len, max_total_num_tokens) - 1 bounds
        # the prompt and clips max_new_tokens (it matters when the pool is the smaller one)
        max_req_len = min(self.context_limit, self.capacity) - 1
        if n > max_req_len - 5:  # SGLang: max_req_input_len
            raise ContextLimitExceeded(
                f"a {n}-token prompt exceeds the maximum request input length "
                f"{max_req_len - 5} of {self.model} (context {self.context_limit}, "
                f"pool {self.capacity} tokens)"
            )
        max_new = min(max_new, max_req_len - n - 1)
        output, finish, on_eos = self._run_model(input_ids, max_new)

        if agent is not None and agent not in self._agents:
            self._agents[agent] = AgentStats()
            self._first_seen[agent] = len(self._first_seen)
        if priority is None:
            priority = self._priority_of(agent)
        loop = asyncio.get_running_loop()
        self._ensure_started(loop)
        fut: asyncio.Future[Generation] = loop.create_future()
        self._rid += 1
        req = _Req(
            self._rid, prompt, output, max_new, finish, on_eos, priority, fut, loop.time(), agent
        )
        self._st.requests += 1
        self._st.prompt_tokens += n
        self._waiting.append(req)
        assert self._wake is not None
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller gave up: the scheduler drops the request at its next boundary.
            if not req.cancelled:
                req.cancelled = True
                self._n_cancelled += 1
            raise

    async def end_agent(self, agent: str) -> None:
        """The agent ended: close its session (its KV stays cached, unreferenced).
        Idempotent."""
        leaf = self._session_leaf.pop(agent, None)
        if leaf is not None:
            self.tree.unref(leaf)

    def cache_stats(self) -> CacheStats:
        """SGLang's load snapshot: refreshed after each prefill iteration, every
        `stats_refresh_decode_steps` decode iterations and when idle (0: always live)."""
        if self.stats_refresh_decode_steps <= 0:
            return self._read_cache()
        return self._snapshot

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(EngineError("the simulated engine was shut down"))
        for agent in list(self._session_leaf):  # like the adapter: open sessions close
            await self.end_agent(agent)

    # ---- inspection ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Cumulative accounting (see docs/simulator.md for each key)."""
        s = asdict(self._st)
        t = self.tree
        s.update(
            evicted_tokens=t.evicted_to_host + t.evicted_dropped,
            evicted_to_host_tokens=t.evicted_to_host,
            host_evicted_tokens=t.host_evicted,
            capacity_tokens=self.capacity,
            host_capacity_tokens=self.hicache_tokens,
            sessions_open=len(self._session_leaf) if self.sessions else None,
        )
        return s

    def agent_stats(self) -> dict[str, dict[str, Any]]:
        """Per-agent accounting, for requests sent with `agent=`."""
        return {k: asdict(v) for k, v in self._agents.items()}

    def _priority_of(self, agent: str | None) -> int:
        """The engine-level priority option, as the SGLang adapter resolves it: an int for
        every request, "fifo" (agents first seen earlier rank higher), or agent -> int."""
        p = self.priority
        if p is None or agent is None:
            return p if isinstance(p, int) else 0
        if isinstance(p, int):
            return p
        if p == "fifo":
            return -self._first_seen[agent]
        value = p(agent)  # type: ignore[operator]
        return 0 if value is None else int(value)

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.tree.device_tokens - self._private

    def check(self) -> None:
        """Verify the memory accounting against the tree and the requests (tests)."""
        self.tree.check()
        reqs = [*self._waiting, *self._running, *([self._chunked] if self._chunked else [])]
        assert sum(r.private for r in reqs) == self._private, "private KV drifted"
        assert self.free_tokens >= 0, f"KV pool overdrawn: {self.free_tokens}"
        holders = sum(1 for r in reqs if r.node is not None and r.node is not self.tree.root)
        top_locks = sum(c.lock for c in self.tree.root.children.values())
        assert holders == top_locks, f"{holders} lock holders, {top_locks} locks"

    # ---- the model double ----------------------------------------------------------

    def _run_model(self, prompt: list[int], max_new: int) -> tuple[Key, str, bool]:
        try:  # called before generate() awaits anything: the caller's list is unchanged
            out = tuple(self._model_fn(prompt))
        except Exception as e:
            raise EngineError(f"simulated model failed: {type(e).__name__}: {e}") from e
        if not out:
            raise EngineError("the simulated model returned no tokens")
        eos = self._eos
        if not eos.isdisjoint(out[:-1]):  # an engine stops at the first EOS
            out = out[: next(i for i, t in enumerate(out) if t in eos) + 1]
        if len(out) > max_new:
            out = out[:max_new]
        on_eos = out[-1] in eos
        finish = "stop" if on_eos or len(out) < max_new else "length"
        return out, finish, on_eos

    # ---- scheduler task ------------------------------------------------------------

    def _ensure_started(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        if self._task is not None and self._loop is not loop and self._pending():
            raise EngineError("the simulated engine is in use on another event loop")
        self._loop = loop
        self._clock = loop if isinstance(loop, VirtualClock) else None
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="sim-engine-scheduler")

    def _pending(self) -> bool:
        return bool(self._waiting or self._running or self._chunked)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._settle()
                if self._n_cancelled:
                    self._drop_cancelled()
                planned = self._schedule_prefill()
                if planned is not None:
                    await self._prefill(*planned)
                elif self._running:
                    await self._decode(loop)
                elif self._chunked is not None or self._waiting:
                    # Nothing runs and nothing can be admitted into an empty engine: the
                    # request at the head can never fit. (generate() rejects such requests;
                    # this guards against a hang.)
                    head = self._chunked or self._waiting[0]
                    self._drop(head)
                    self._st.requests_failed += 1
                    if not head.fut.done():
                        head.fut.set_exception(EngineError("request does not fit the KV pool"))
                else:
                    await self._idle(loop)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a simulator bug must fail the requests, not hang them
            self._error = e
            self._fail_all(EngineError(f"the simulated engine failed: {type(e).__name__}: {e}"))

    async def _settle(self) -> None:
        """Let every callback that is ready now run before planning an iteration: agents
        woken by the last iteration's results submit their next requests at this instant."""
        clock = self._clock
        if clock is None:
            await asyncio.sleep(0)
            return
        for _ in range(100):
            if not clock.has_ready_callbacks():
                return
            await asyncio.sleep(0)

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._wake is not None
        self._ratio = self._ratio_init  # SGLang resets new_token_ratio when idle
        self._snapshot = self._read_cache()
        self._wake.clear()
        t0 = loop.time()
        cached, free = self.tree.evictable_tokens, self.free_tokens
        await self._wake.wait()
        waited = loop.time() - t0
        self._st.seconds_idle += waited
        # nothing runs, so nothing is locked: the pool is cached or free
        self._st.kv_token_seconds_cached += cached * waited
        self._st.kv_token_seconds_free += (self.capacity - cached) * waited
        assert free == self.capacity - cached, "KV locked while the engine is idle"

    # ---- memory --------------------------------------------------------------------

    def _reserve(self, n: int) -> bool:
        """Evict until n tokens are free. False if the tree cannot give enough."""
        free = self.free_tokens
        if free < n:
            self.tree.evict(n - free)
            free = self.free_tokens
        return free >= n

    def _alloc(self, req: _Req, n: int) -> None:
        if not self._reserve(n):
            raise RuntimeError(f"KV pool accounting: cannot allocate {n} tokens")
        req.private += n
        self._private += n

    def _cache_unfinished(self, req: _Req, upto: int) -> None:
        """SGLang cache_unfinished_req: put fill[:upto] into the tree, free the request's
        copies of tokens the tree already had, and move its lock to the new end node."""
        ins = self.tree.insert(req.fill[req.prefix : upto], priority=req.priority, at=req.node)
        moved = upto - req.prefix
        req.private -= moved
        self._private -= moved
        self.tree.inc_lock(ins.node)
        assert req.node is not None
        self.tree.dec_lock(req.node)
        req.node, req.prefix = ins.node, upto

    def _release(self, req: _Req) -> None:
        """Free the request's private KV and unlock its prefix (retraction, cancellation)."""
        self._private -= req.private
        req.private = 0
        if req.node is not None:
            self.tree.dec_lock(req.node)
        req.node, req.prefix, req.done = None, 0, 0

    @staticmethod
    def _kv_len(req: _Req) -> int:
        """Tokens whose KV the request has computed: prompt + output minus the last
        sampled token (its KV is only written by the next decode step)."""
        return len(req.prompt) + req.out_len - 1

    @staticmethod
    def _seq(req: _Req, start: int, end: int) -> Key:
        """(prompt + output)[start:end] without building the whole sequence."""
        p = len(req.prompt)
        if end <= p:
            return req.prompt[start:end]
        if start >= p:
            return req.output[start - p : end - p]
        return req.prompt[start:] + req.output[: end - p]

    # ---- prefill -------------------------------------------------------------------

    def _schedule_prefill(self) -> tuple[list[_Chunk], int] | None:
        """SGLang get_new_batch_prefill + PrefillAdder. Returns the chunks to compute and
        the host tokens loaded back, or None when no prefill batch can be formed."""
        if not self._running:
            self._batch_is_full = False
        if (self._batch_is_full or not self._waiting) and self._chunked is None:
            return None
        tree = self.tree
        # output estimates of the running requests (PrefillAdder.rem_total_token_offset)
        offset = 0.0
        for r in self._running:
            left = r.max_new - r.out_len
            offset += left if left < CLIP_MAX_NEW_TOKENS else CLIP_MAX_NEW_TOKENS
        offset *= self._ratio

        def rem_total() -> float:
            # Allocation happens here at admission (SGLang: when the batch is prepared), so
            # free already excludes the admitted requests' new tokens.
            return self.free_tokens + tree.evictable_tokens - offset

        rem_chunk, rem_input = self.chunked_prefill_size, self.max_prefill_tokens
        batch: list[_Chunk] = []
        host_tokens = 0

        if self._chunked is not None:  # PrefillAdder.add_chunked_req
            r = self._chunked
            n = min(rem_chunk, int(rem_total()), r.fill_len - r.done)
            if n > 0:
                self._alloc(r, n)
                batch.append(_Chunk(r, r.done, r.done + n, self._recompute(r, r.done, n)))
                rem_chunk -= n
                rem_input -= n
                if r.done + n == r.fill_len:
                    offset += min(max(r.max_new - r.out_len, 0), CLIP_MAX_NEW_TOKENS)

        admitted: list[_Req] = []
        if not self._batch_is_full:
            for r in self._queue_order():
                if rem_chunk <= 0 or rem_input <= 0:
                    break  # AddReqResult.OTHER: this iteration's prefill budget is spent
                if len(self._running) + len(batch) >= self.max_running_requests:
                    self._batch_is_full = True
                    break
                fill = r.prompt if r.out_len == 0 else r.prompt + r.output[: r.out_len]
                fill_len = len(fill)
                m = tree.match_prefix(fill, fill_len - 1)  # SGLang: at most len - 1 cached
                host = (
                    m.host_len if self.hicache_tokens and m.host_len >= LOAD_BACK_THRESHOLD else 0
                )
                prefix = m.device_len + host
                extend = fill_len - prefix
                reserve = min(max(r.max_new - r.out_len, 0), CLIP_MAX_NEW_TOKENS)
                need = extend + host + reserve
                if need >= rem_total():
                    self._batch_is_full = True  # AddReqResult.NO_TOKEN
                    break
                # No input cap for a request behind others: SGLang (0.5.16 on) checks
                # max_prefill_tokens there only without chunked prefill, so a long one takes
                # the chunk left (0.5.9 stopped the batch: AddReqResult.OTHER)
                tree.inc_lock(m.device_node)
                if need >= rem_total():  # locking made part of the evictable memory protected
                    tree.dec_lock(m.device_node)
                    self._batch_is_full = True
                    break
                node = m.device_node
                if host:  # HiCache load_back: host part of the match back to device
                    tree.load_back(m.node)
                    tree.inc_lock(m.node)
                    tree.dec_lock(m.device_node)
                    node = m.node
                    host_tokens += host
                    self._reserve(0)  # the loaded tokens may have overdrawn free memory
                r.fill, r.fill_len, r.node, r.prefix, r.done = fill, fill_len, node, prefix, prefix
                # capped like the device match: the last token is always computed, and it
                # is not a recompute when the cache holds it but SGLang cannot use it
                sm = self.shadow.match_prefix(fill, fill_len - 1)
                r.shadow_node, r.shadow_len = sm.node, sm.length
                self._account_hit(r, m.device_len, host)
                n = min(extend, rem_chunk)
                self._alloc(r, n)
                batch.append(_Chunk(r, prefix, prefix + n, self._recompute(r, prefix, n)))
                admitted.append(r)
                rem_chunk -= n
                rem_input -= n
                if n < extend:
                    self._chunked = r
                    break
                offset += reserve
        if admitted:
            if self._waiting[: len(admitted)] == admitted:
                del self._waiting[: len(admitted)]
            else:  # lpm order
                taken = set(map(id, admitted))
                self._waiting = [r for r in self._waiting if id(r) not in taken]
        if not batch:
            return None
        return batch, host_tokens

    def _queue_order(self) -> list[_Req]:
        if self.schedule_policy == "lpm" and 1 < len(self._waiting) <= LPM_MAX_QUEUE:
            # longest prefix match first (stable, so FCFS among equals)
            def cached(r: _Req) -> int:
                fill = r.prompt if r.out_len == 0 else r.prompt + r.output[: r.out_len]
                return self.tree.prefix_len(fill, len(fill) - 1)

            return sorted(self._waiting, key=cached, reverse=True)
        return self._waiting  # not mutated while iterated: admitted ones are removed after

    def _account_hit(self, r: _Req, device: int, host: int) -> None:
        if r.cached is None:
            r.cached, r.cached_host = device + host, host
            self._st.cached_tokens += device + host
            self._st.device_hit_tokens += device
            self._st.host_hit_tokens += host
        else:
            self._st.readmit_cached_tokens += device + host

    def _recompute(self, r: _Req, start: int, n: int) -> int:
        """Tokens of fill[start:start+n] whose KV was computed before (the shadow tree had
        them at admission) but is cached neither on device nor on host now."""
        return max(0, min(start + n, r.shadow_len) - start)

    def _record_computed(self, r: _Req, n: int) -> None:
        """Add the request's first n tokens (KV it computed) to the shadow tree. Its tokens
        are on device and locked while it runs, so the shadow only needs them when it
        leaves (finish, retraction, cancellation)."""
        if n > r.shadow_len:
            ins = self.shadow.insert(self._seq(r, r.shadow_len, n), at=r.shadow_node)
            r.shadow_node, r.shadow_len = ins.node, n

    async def _prefill(self, batch: list[_Chunk], host_tokens: int) -> None:
        sampled = sum(1 for c in batch if c.end == c.req.fill_len)
        recompute = sum(c.recompute for c in batch)
        cost = self.cost.prefill([(c.start, c.end) for c in batch], recompute, host_tokens, sampled)
        st = self._st
        st.iterations += 1
        st.prefill_iterations += 1
        st.seconds_busy += cost.seconds
        st.seconds_prefill_new += cost.prefill_new
        st.seconds_prefill_recompute += cost.prefill_recompute
        st.seconds_host_load += cost.host_load
        tokens = sum(c.end - c.start for c in batch)
        st.tokens_prefill_new += tokens - recompute
        st.tokens_prefill_recompute += recompute
        st.tokens_host_load += host_tokens
        cached, free = self.tree.evictable_tokens, self.free_tokens
        st.kv_token_seconds_prefilling += (self.capacity - cached - free) * cost.seconds
        st.kv_token_seconds_cached += cached * cost.seconds
        st.kv_token_seconds_free += free * cost.seconds
        await asyncio.sleep(cost.seconds)

        for c in batch:
            r = c.req
            r.recomputed += c.recompute
            self._cache_unfinished(r, c.end)
            r.done = c.end
            if c.end < r.fill_len:
                continue  # chunked: the next chunk comes first in the next prefill batch
            if self._chunked is r:
                self._chunked = None
            r.out_len += 1  # the prefill samples the next token
            if r.out_len >= len(r.output):
                self._finish(r)
            else:
                self._running.append(r)
        st.max_running = max(st.max_running, len(self._running))
        self._snapshot = self._read_cache()

    # ---- decode --------------------------------------------------------------------

    async def _decode(self, loop: asyncio.AbstractEventLoop) -> None:
        retracted = False
        if not self._reserve(len(self._running)):  # ScheduleBatch.check_decode_mem
            self._retract()
            retracted = True
            if not self._reserve(len(self._running)):
                raise RuntimeError("no KV memory for a single decoding request")
        running = self._running
        bs = len(running)
        ctx = 0
        k = self.fast_forward_cap
        for r in running:
            ctx += len(r.prompt) + r.out_len
            left = len(r.output) - r.out_len
            if left < k:
                k = left
        if retracted or (self._waiting and not self._batch_is_full):
            k = 1  # admission is retried before the next iteration
        k = max(1, min(k, (self.free_tokens + self.tree.evictable_tokens) // bs))

        # Spend k iterations, or fewer: stop with the one during which the next timer fires.
        deadline = (self._clock.next_timer() if self._clock else math.inf) - loop.time()
        locked = self.capacity - self.tree.evictable_tokens - self.free_tokens
        seconds, steps, held = 0.0, 0, 0.0
        while steps < k:
            step = self.cost.decode(bs, ctx + steps * bs)
            seconds += step
            held += step * (locked + steps * bs)  # each step holds the KV of the one before
            steps += 1
            if seconds >= deadline:
                break
        if not self._reserve(bs * steps):
            raise RuntimeError("KV pool accounting: decode block over memory")
        cached = self.tree.evictable_tokens  # after the block's evictions
        for r in running:
            r.private += steps
        self._private += bs * steps
        st = self._st
        st.iterations += steps
        st.decode_iterations += steps
        st.decode_blocks += 1
        st.seconds_busy += seconds
        st.seconds_decode += seconds
        st.tokens_decode += bs * steps
        st.kv_token_seconds_decoding += held
        st.kv_token_seconds_cached += cached * seconds
        st.kv_token_seconds_free += (self.capacity - cached) * seconds - held
        await asyncio.sleep(seconds)

        finished = []
        for r in running:
            r.out_len += steps
            if r.out_len >= len(r.output):
                finished.append(r)
        if not retracted:
            self._ratio = max(self._ratio - steps * self._ratio_decay, self._ratio_min)
        if finished:
            self._running = [r for r in running if r.out_len < len(r.output)]
            self._batch_is_full = False  # the running batch shrank
            for r in finished:
                self._finish(r)
        before = self._decode_steps
        self._decode_steps += steps
        every = self.stats_refresh_decode_steps
        if every > 0 and self._decode_steps // every != before // every:
            self._snapshot = self._read_cache()

    def _retract(self) -> None:
        """SGLang ScheduleBatch.retract_decode: preempt the requests with the fewest output
        tokens (then the longest prompts) until the rest can decode; at least one goes."""
        order = sorted(self._running, key=lambda r: (r.out_len, -len(r.prompt)), reverse=True)
        out: list[_Req] = []
        first = True
        while first or not self._reserve(len(order)):
            if len(order) == 1:
                break
            first = False
            r = order.pop()
            self._st.retracted_tokens += r.private
            self._record_computed(r, self._kv_len(r))  # readmitted, it recomputes all this
            self._release(r)
            r.retractions += 1
            out.append(r)
            # release_req: make room for the remaining requests' next decode steps
            self._reserve(len(order) * RETRACT_DECODE_STEPS)
        taken = set(map(id, out))
        self._running = [r for r in self._running if id(r) not in taken]
        decoded = sum(r.out_len for r in self._running)
        budget = sum(r.max_new for r in self._running)
        if budget:
            est = (decoded + RETRACT_DECODE_STEPS * len(self._running)) / budget
            self._ratio = min(1.0, est)
        self._waiting.extend(out)  # SGLang appends retracted requests to the queue
        self._batch_is_full = False
        self._st.retractions += len(out)

    # ---- endings -------------------------------------------------------------------

    def _finish(self, r: _Req) -> None:
        """SGLang cache_finished_req: the request's KV goes into the tree, unlocked."""
        n = self._kv_len(r)
        ins = self.tree.insert(self._seq(r, r.prefix, n), priority=r.priority, at=r.node)
        if self.sessions and r.agent is not None:
            old = self._session_leaf.get(r.agent)
            if old is not ins.node:
                self.tree.ref(ins.node)
                self._session_leaf[r.agent] = ins.node
                if old is not None:
                    self.tree.unref(old)
        self._private -= r.private
        r.private = 0
        if r.node is not None:
            self.tree.dec_lock(r.node)
            r.node = None
        self._record_computed(r, n)
        loop = self._loop
        now = loop.time() if loop is not None else 0.0
        self._st.requests_finished += 1
        a = self._agents.get(r.agent) if r.agent is not None else None
        if a is not None:
            a.requests += 1
            a.prompt_tokens += len(r.prompt)
            a.cached_tokens += r.cached or 0
            a.host_hit_tokens += r.cached_host
            a.recomputed_tokens += r.recomputed
            a.completion_tokens += len(r.output)
            a.retractions += r.retractions
            a.engine_seconds += now - r.t_arrival
        if self.on_finish is not None:
            record = RequestRecord(
                rid=r.rid,
                agent=r.agent,
                prompt_tokens=len(r.prompt),
                cached_tokens=r.cached or 0,
                cached_host_tokens=r.cached_host,
                recomputed_tokens=r.recomputed,
                completion_tokens=len(r.output),
                retractions=r.retractions,
                arrival=r.t_arrival,
                finish=now,
            )
            self.on_finish(r.prompt, record)
        if r.fut.done():
            return
        on_eos = r.stopped_on_eos
        visible = list(r.output[:-1] if on_eos else r.output)
        r.fut.set_result(
            Generation(
                output_ids=list(r.output),
                text=self._tok.decode(visible),
                prompt_tokens=len(r.prompt),
                cached_tokens=r.cached or 0,
                completion_tokens=len(r.output),
                finish_reason=r.finish_reason,
                seconds=now - r.t_arrival,
                cached_host_tokens=r.cached_host,
                stopped_on_eos=on_eos,
            )
        )

    def _drop(self, r: _Req) -> None:
        """Take a request out of the engine without finishing it."""
        if self._chunked is r:
            self._chunked = None
        if r in self._running:
            self._running.remove(r)
            self._batch_is_full = False
            self._record_computed(r, self._kv_len(r))
        elif r.done:
            self._record_computed(r, r.done)
        if r in self._waiting:
            self._waiting.remove(r)
        self._release(r)

    def _drop_cancelled(self) -> None:
        for r in [*self._waiting, *self._running, *([self._chunked] if self._chunked else [])]:
            if r.cancelled:
                self._drop(r)
                self._st.requests_cancelled += 1
        self._n_cancelled = 0

    def _fail_all(self, err: EngineError) -> None:
        reqs = [*self._waiting, *self._running, *([self._chunked] if self._chunked else [])]
        for r in reqs:
            if not r.fut.done():
                r.fut.set_exception(err)
        self._waiting, self._running, self._chunked = [], [], None

    # ---- signals -------------------------------------------------------------------

    def _read_cache(self) -> CacheStats:
        cap = self.capacity
        free = self.free_tokens
        evictable = self.tree.evictable_tokens
        used = cap - free - evictable  # SGLang token_usage: running + locked prefixes
        return CacheStats(
            usage=used / cap,
            capacity_tokens=cap,
            used_tokens=used,
            host_capacity_tokens=self.hicache_tokens or None,
            # a reload over PCIe against the floor of a recompute (its linear FLOPs)
            host_reload_cost=(
                self.cost.host_load(1) / self.cost.prefill_linear_per_token
                if self.hicache_tokens
                else None
            ),
            recompute_token_seconds=self._recompute_token_seconds,
            host_reload_token_seconds=self.cost.host_load(1) if self.hicache_tokens else None,
            extra={
                "physical_occupancy": (cap - free) / cap,
                "free_tokens": free,
                "evictable_tokens": evictable,
                "protected_tokens": self.tree.protected_tokens,
                "private_tokens": self._private,
                "host_tokens": self.tree.host_tokens,
                "host_only_tokens": self.tree.host_only_tokens,
                "host_capacity_tokens": self.hicache_tokens,
                "running": len(self._running) + (1 if self._chunked else 0),
                "waiting": len(self._waiting),
                "new_token_ratio": self._ratio,
                "retractions": self._st.retractions,
            },
        )
