"""An oracle lower bound on a simulated batch's time, from the same cost model.

No schedule can finish sooner than either of:
- the engine's work with nothing ever recomputed and the GPU never idle: every fresh token
  prefilled once (as if in one batch, plus one launch cost per full chunk; the shared system
  prompt once), every generated token decoded in iterations as large as the whole batch
  (weights read once per iteration, the KV of each token's context read once);
- the longest agent's own serial chain: its prefills and its decodes at batch 1, plus its
  tools, one after another;
- the KV pool's memory-time: every agent's context must be resident while it generates
  (at least its batch-1 decode time) and, unless it is dropped and later recomputed, while
  its tool runs; the pool holds `capacity` tokens at a time, so time x capacity must cover
  the token-seconds kept. Dropping trades memory for compute: each dropped token saves its
  tool's seconds of residency and costs its linear prefill FLOPs (or, with a host tier,
  its PCIe reload). The cheapest trade drops the longest tools' contexts first; the bound is
  the time where the engine's work plus those recomputes equals the memory-time left.
Template tokens the runner adds around each turn are left out, which only lowers the bound.
"""

from __future__ import annotations

import math
from typing import Any

from .engine import CostModel
from .engine import deployment as sim_deployment
from .workload import Workload

CHUNK = 8192  # SGLang's default chunked_prefill_size


def lower_bound(
    workload: Workload,
    deployment: str,
    host_tier: bool = False,
    pcie_bytes_per_s: float | None = None,
    **deployment_overrides: Any,
) -> dict:
    """host_tier: evicted KV can be reloaded from host memory (HiCache, at pcie_bytes_per_s
    per GPU, default the preset's) where that is cheaper than recomputing it; the host
    tier's size is not a constraint here, which only lowers the bound."""
    dep = sim_deployment(deployment, **deployment_overrides)
    cost = CostModel(dep, pcie_bytes_per_s)
    fixed = cost.prefill_fixed  # per prefill iteration: paid once per full chunk here
    segments_all: list[tuple[int, int]] = []  # every fresh prefill, any agent
    fresh_tokens = 0
    gen_tokens = 0
    ctx_reads = 0  # sum over generated tokens of the context they attend to
    chains = []
    held = 0.0  # token-seconds every agent's context must stay resident while it generates
    tool_items: list[tuple[float, int]] = []  # (tool seconds, context tokens held meanwhile)
    sys_tokens = workload.system_tokens
    if sys_tokens:
        segments_all.append((0, sys_tokens))
        fresh_tokens += sys_tokens
    for a in workload.agents:
        ctx = sys_tokens + a.prompt_tokens
        segments = [(sys_tokens, ctx)]  # positions prefilled fresh, one per step
        chain = 0.0
        for i, s in enumerate(a.steps):
            start, end = segments[-1]
            segments_all.append((start, end))
            fresh_tokens += end - start
            chain += cost.prefill([(start, end)]).seconds  # its own iteration at least
            # decode s.gen_tokens tokens, contexts ctx+1 .. ctx+gen
            reads = s.gen_tokens * ctx + s.gen_tokens * (s.gen_tokens + 1) // 2
            ctx_reads += reads
            gen_tokens += s.gen_tokens
            # decode(1, c) is convex in c: gen x its value at the mean context is a lower bound
            gen_seconds = s.gen_tokens * cost.decode(1, ctx + (s.gen_tokens + 1) // 2)
            chain += gen_seconds
            held += (ctx - sys_tokens) * gen_seconds  # the shared prompt is left out
            ctx += s.gen_tokens
            if i < len(a.steps) - 1:
                chain += s.tool_seconds
                tool_items.append((s.tool_seconds, ctx - sys_tokens))
                segments.append((ctx, ctx + s.obs_tokens))
                ctx += s.obs_tokens
        chains.append(chain)
    # Prefill as one iteration over every segment (weights read once, one all-reduce
    # latency): no batching of the same work can be cheaper; the fixed launch cost is paid
    # once per chunk of fresh tokens at least.
    n_sampled = len(segments_all) - (1 if sys_tokens else 0)
    batched = cost.prefill(segments_all, sampled=n_sampled) if segments_all else None
    body = batched.seconds - fixed if batched else 0.0
    prefill = body + math.ceil(fresh_tokens / CHUNK) * fixed
    # Recompute adds compute; where the batched prefill is memory-bound, that much of it
    # could hide under the weight reads, so the memory term starts that much lower.
    slack = max(0.0, batched.parts["memory"] - batched.parts["compute"]) if batched else 0.0
    # Decode in iterations of the whole batch; the per-iteration batch is rounded down so
    # the bound never counts more tokens than were generated.
    iters = math.ceil(gen_tokens / max(1, len(workload.agents)))
    batch = gen_tokens // iters if iters else 0
    decode = iters * cost.decode(batch, ctx_reads // iters) if iters else 0.0
    # Every request in one decode iteration is resident at once: their contexts (the shared
    # prompt once) fit the pool, so there are at least this many iterations.
    private_reads = ctx_reads - gen_tokens * sys_tokens
    mem_iters = math.ceil(private_reads / max(1, dep.pool_tokens - sys_tokens))
    decode = max(decode, _decode_floor(cost, mem_iters, gen_tokens, ctx_reads))
    engine = prefill + decode
    chain = max(chains, default=0.0)
    # a dropped token costs the floor of its recompute, or its reload where a host tier
    # makes that cheaper
    per_token = cost.prefill_linear_per_token
    if host_tier:
        per_token = min(per_token, cost.host_load(1))
    # the full pool: the shared prompt's own residency is left out of `held` instead
    memory = max(
        engine, _memory_bound(engine - slack, held, tool_items, dep.pool_tokens, per_token)
    )
    return {
        "bound_seconds": round(max(memory, chain), 3),
        "engine_bound_seconds": round(engine, 3),
        "memory_bound_seconds": round(memory, 3),
        "prefill_seconds": round(prefill, 3),
        "decode_seconds": round(decode, 3),
        "longest_chain_seconds": round(chain, 3),
    }


def _decode_floor(cost: CostModel, iters: int, gen_tokens: int, ctx_reads: int) -> float:
    """A floor on `gen_tokens` decoded in `iters` iterations however they are batched: each
    reads at least one token's weights, pays its launch cost and its all-reduce latency;
    across them the KV reads and the FLOPs add up (a sum of maxima is at least the max of
    the sums), and the all-reduce bytes grow linearly with the batch."""
    if iters <= 0 or gen_tokens <= 0:
        return 0.0
    iters = min(iters, gen_tokens)
    one, two = cost.decode_parts(1, 0), cost.decode_parts(2, 0)
    kv = cost.decode_parts(1, 1)["memory"] - one["memory"]  # seconds per context token read
    flops_tok = two["compute"] - one["compute"]
    flops_ctx = cost.decode_parts(1, 1)["compute"] - one["compute"]
    ar_tok = two["allreduce"] - one["allreduce"]
    memory = iters * one["memory"] + kv * ctx_reads
    compute = flops_tok * gen_tokens + flops_ctx * ctx_reads
    allreduce = iters * (one["allreduce"] - ar_tok) + ar_tok * gen_tokens
    return max(memory, compute) + allreduce + iters * one["overhead"]


def _memory_bound(
    engine: float,
    held: float,
    tool_items: list[tuple[float, int]],
    capacity: int,
    per_token: float,
) -> float:
    """min over drops of max(engine + drop cost, memory-time left / capacity). Dropping a
    token held through a t-second tool saves t token-seconds for per_token seconds of work,
    so the longest tools go first (a fractional knapsack: greedy is optimal)."""
    if capacity <= 0:
        return math.inf
    memory = held + sum(t * n for t, n in tool_items)
    spent = 0.0
    for t, n in sorted(tool_items, key=lambda item: -item[0]):
        if engine + spent >= memory / capacity:
            break
        # drop x of these n tokens: engine + spent + x*per_token == (memory - x*t) / capacity
        x = (memory / capacity - engine - spent) / (per_token + t / capacity)
        if x <= n:
            return engine + spent + x * per_token
        spent += n * per_token
        memory -= n * t
    return max(engine + spent, memory / capacity)
