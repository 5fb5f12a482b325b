"""An oracle lower bound on a simulated batch's time, from the same cost model.

No schedule can finish sooner than either of:
- the engine's work with nothing ever recomputed and the GPU never idle: every fresh token
  prefilled once (in full chunks, the shared system prompt once), every generated token
  decoded in iterations as large as the whole batch (weights read once per iteration, the
  KV of each token's context read once);
- the longest agent's own serial chain: its prefills and its decodes at batch 1, plus its
  tools, one after another.
Template tokens the runner adds around each turn are left out, which only lowers the bound.
"""

from __future__ import annotations

import math
from typing import Any

from .engines.sim import CostModel
from .engines.sim import deployment as sim_deployment
from .workload import Workload

CHUNK = 8192  # SGLang's default chunked_prefill_size


def lower_bound(workload: Workload, deployment: str, **deployment_overrides: Any) -> dict:
    cost = CostModel(sim_deployment(deployment, **deployment_overrides))
    fixed = cost.prefill_fixed  # per prefill iteration: paid once per full chunk here
    prefill_body = 0.0
    fresh_tokens = 0
    gen_tokens = 0
    ctx_reads = 0  # sum over generated tokens of the context they attend to
    chains = []
    sys_tokens = workload.system_tokens
    if sys_tokens:
        prefill_body += cost.prefill([(0, sys_tokens)]).seconds - fixed
        fresh_tokens += sys_tokens
    for a in workload.agents:
        ctx = sys_tokens + a.prompt_tokens
        segments = [(sys_tokens, ctx)]  # positions prefilled fresh, one per step
        chain = 0.0
        for i, s in enumerate(a.steps):
            start, end = segments[-1]
            body = cost.prefill([(start, end)]).seconds - fixed
            prefill_body += body
            fresh_tokens += end - start
            chain += body + fixed
            # decode s.gen_tokens tokens, contexts ctx+1 .. ctx+gen
            reads = s.gen_tokens * ctx + s.gen_tokens * (s.gen_tokens + 1) // 2
            ctx_reads += reads
            gen_tokens += s.gen_tokens
            # decode(1, c) is convex in c: gen x its value at the mean context is a lower bound
            chain += s.gen_tokens * cost.decode(1, ctx + (s.gen_tokens + 1) // 2)
            ctx += s.gen_tokens
            if i < len(a.steps) - 1:
                chain += s.tool_seconds
                segments.append((ctx, ctx + s.obs_tokens))
                ctx += s.obs_tokens
        chains.append(chain)
    batch = max(1, len(workload.agents))
    iters = math.ceil(gen_tokens / batch)
    decode = iters * cost.decode(batch, ctx_reads // max(1, iters))
    prefill = prefill_body + math.ceil(fresh_tokens / CHUNK) * fixed
    engine = prefill + decode
    chain = max(chains, default=0.0)
    return {
        "bound_seconds": round(max(engine, chain), 3),
        "engine_bound_seconds": round(engine, 3),
        "prefill_seconds": round(prefill, 3),
        "decode_seconds": round(decode, 3),
        "longest_chain_seconds": round(chain, 3),
    }
