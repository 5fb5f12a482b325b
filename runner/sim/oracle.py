"""An oracle lower bound on a simulated batch's time, from the same cost model.

No schedule can finish sooner than any of:
- the engine's work with nothing ever recomputed and the GPU never idle: every fresh token
  prefilled once (as if in one batch, plus one launch cost per full chunk; the shared system
  prompt once), every decoded token in iterations as large as the whole batch (weights read
  once per iteration, the KV of each token's context read once), and at least as many
  decode iterations as the pool needs to hold the contexts they read;
- the longest agent's own serial chain: its prefills and its decodes at batch 1, plus its
  tools, one after another; and that chain with the GPU it shares: the other agents' decode
  tokens either ride in its decode iterations, each lengthening them, or run in iterations
  without it, which fit only in its tools or hold it up;
- the KV pool's memory-time: `capacity` x time must cover the token-seconds the contexts are
  resident. Every context is resident while a token of it is produced (the whole iteration)
  and, unless it is dropped and later recomputed, while its tool runs. Producing tokens in
  fewer iterations makes each iteration read more KV (longer) while more contexts are
  resident (larger): with N such iterations the decode residency is at least base x R' + k x
  R'^2 / N (Cauchy-Schwarz), and the engine needs at least N iterations' fixed cost. The bound
  takes the N that is best for the schedule. Dropping trades memory for compute: each dropped
  token saves its tool's seconds of residency and costs its recompute (linear FLOPs and the
  attention of its position), cheapest per token-second first, paid both by the engine and
  by the dropping agent's own chain; with a host tier a dropped token may instead be
  reloaded, which the forward can hide (the copy runs beside it, layer by layer) but the
  PCIe link cannot: at most time / (seconds per token reloaded) tokens come back, those of
  the longest tools first. Nor can the pool be full from the start: at each instant it
  holds at most what the agents' chains can have grown to by then, and only tokens the
  GPU has had the FLOPs to compute. The bound is the least time at which all of this fits.
The engine term also counts the decode iterations SGLang's admission reserve forces (each
admission needs min(max_new, 4096) free beyond the running requests' contexts and >= 0.098 x
their reserves), and the memory term's decode iterations fit in the time the prefill leaves;
both, like the engine term and the shared chain, for runs that never retract (every bench
run). MoE decode iterations read the experts a batch adds (the concave chord).
Each step produces its first token in its prefill and the rest in decode iterations. For a
batch run through the runner (the default), the bound is taken over the prompts the runner
sends (`Workload.as_sent`: its chat template and tool instructions counted exactly, the shared
prefix once, agents ended where the runner ends them at the context limit); a driver without
the runner, or a trace with a reply the engine would clip, gets the bound over the trace's own
tokens, which leaves the runner's out.
docs/simulator.md ("The oracle lower bound") gives each term's argument.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from .engine import CostModel
from .engine import deployment as sim_deployment
from .engine.scheduler import CLIP_MAX_NEW_TOKENS, INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO_FACTOR
from .workload import Workload

CHUNK = 8192  # SGLang's default chunked_prefill_size
MAX_NEW_TOKENS = 4096  # what the simulated runner asks per request (simulate.SIM_SAMPLING)
# the least new_token_ratio a run that never retracts sees (schedule_conservativeness 1)
MIN_RATIO = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
# template tokens the runner adds to an agent's context, at most (its instructions once, the
# chat template per turn; tests/sim/test_oracle.py measures them): only used to tell whether the
# engine's clip of max_new_tokens can bind
TEMPLATE_ONCE, TEMPLATE_PER_TURN = 512, 64
SHARED_AGENTS = 8  # agents, longest chains first, that _shared_chain_bound is taken over


@dataclass
class Totals:
    """What the bound needs from a workload, in one pass over its steps."""

    segments: list[tuple[int, int]] = field(default_factory=list)  # every fresh prefill
    fresh: int = 0  # fresh prefill tokens
    sampled: int = 0  # prefills that sample a token (one per step)
    decode: int = 0  # tokens produced after each step's first (G)
    reads: int = 0  # sum over them of the context they attend (R)
    private_reads: int = 0  # the same without the shared prompt (R')
    squares: int = 0  # sum over them of (private context)^2 (Q)
    chains: list[float] = field(default_factory=list)  # each agent's serial chain
    # (tool seconds, private context held meanwhile, its whole context, agent)
    tools: list[tuple[float, int, int, int]] = field(default_factory=list)
    # per agent: seconds of recompute its own prefills can hide under their weight reads
    hidden: list[float] = field(default_factory=list)
    # admission: sum over decoding steps of (g - 1) x (private prompt + MIN_RATIO x (reserve
    # - 1)), and the least reserve min(max_new, 4096) of those steps (_admission_iters)
    admission: float = 0.0
    reserve_min: int = CLIP_MAX_NEW_TOKENS
    # the least a decoding step adds to a batch's sum above, and its least private context
    admission_min: float = math.inf
    private_min: int = 0
    # per agent, for _shared_chain_bound: decode tokens, their reads, tool seconds, its
    # prefills' compute seconds and the weight-read seconds those prefills leave above it
    agent_decode: list[int] = field(default_factory=list)
    agent_reads: list[int] = field(default_factory=list)
    agent_tools: list[float] = field(default_factory=list)
    agent_compute: list[float] = field(default_factory=list)
    agent_slack: list[float] = field(default_factory=list)
    # per agent: fresh prefill tokens, and the most tokens of others its prefill iterations
    # can hold (_prefill_room, summed over its steps)
    agent_fresh: list[int] = field(default_factory=list)
    agent_room: list[int] = field(default_factory=list)
    # per decoding step: (least context its tokens attend, tokens, admission weight)
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    agent_admission: list[float] = field(default_factory=list)
    # (time, tokens): from `time` on an agent may hold `tokens` more private context, the
    # time being when its chain could first reach the step that adds them (_fill)
    growth: list[tuple[float, int]] = field(default_factory=list)


def _prefill_room(fresh: int) -> int:
    """The most tokens of other requests the iterations that prefill one request's `fresh`
    tokens can hold. Only its first and its last chunk share an iteration: a continuation is
    placed first in its iteration and takes a whole chunk, or the pool truncates it and then
    nothing fits after it (every admission needs a token). The first and the last chunk
    hold a token each of its own at least, so 2 x CHUNK - 2 (one chunk less a token if a
    single token cannot be split)."""
    if fresh <= 0:
        return 0
    return CHUNK - 1 if fresh == 1 else 2 * CHUNK - 2


def longest_prompt(workload: Workload, agent: int, template: bool = True) -> int:
    """At most what any request of an agent holds: its final context (the shared prompt
    included) plus, unless the workload counts them already (`template` False: a trace
    as sent), the runner's template tokens."""
    a = workload.agents[agent]
    extra = TEMPLATE_ONCE + TEMPLATE_PER_TURN * len(a.steps) if template else 0
    return workload.system_tokens + a.total_tokens() + extra


def _reserve(workload: Workload, cost: CostModel, agent: int, template: bool = True) -> int:
    """A floor on min(max_new_tokens, 4096) of every request of an agent, which the engine
    clips to min(context, pool) - 2 - prompt: its prompts are at most `longest_prompt`. 0
    (no credit) where the clip could bind."""
    limit = min(cost.d.max_context, cost.d.pool_tokens) - 2
    longest = longest_prompt(workload, agent, template)
    want = min(MAX_NEW_TOKENS, CLIP_MAX_NEW_TOKENS)
    return want if limit - longest >= want else 0


def totals(workload: Workload, cost: CostModel, template: bool = True) -> Totals:
    """The work of a batch the bounds are made of (each agent's chain of steps, the fresh
    prefill, the decode steps, the admissions): what `lower_bound` sums, for the benchmarks
    that place it in time (bench/bound_gap.py, bench/order.py,
    bench/constructed_schedule.py)."""
    tot = Totals()
    sys_tokens = workload.system_tokens
    if sys_tokens:
        tot.segments.append((0, sys_tokens))
        tot.fresh += sys_tokens
    for agent, a in enumerate(workload.agents):
        start, ctx = sys_tokens, sys_tokens + a.prompt_tokens  # this step's fresh prefill
        chain = hidden = tools = compute = slack = 0.0
        decode, reads, admission, fresh, room = tot.decode, tot.reads, tot.admission, tot.fresh, 0
        reserve = _reserve(workload, cost, agent, template)
        held = 0  # the most private context it may hold so far (_fill)
        for i, s in enumerate(a.steps):
            tot.segments.append((start, ctx))
            tot.fresh += ctx - start
            room += _prefill_room(ctx - start)
            tot.sampled += 1
            solo = cost.prefill([(start, ctx)])  # its own iteration at least
            chain += solo.seconds
            # its decode and its tool hold at most ctx + g private tokens, from now on
            tot.growth.append((chain, ctx + s.gen_tokens - sys_tokens - held))
            held = ctx + s.gen_tokens - sys_tokens
            compute += solo.parts["compute"]
            slack += max(0.0, solo.parts["memory"] - solo.parts["compute"])
            if i:  # where recompute of what it lost in the tool before would land
                hidden += max(0.0, solo.parts["memory"] - solo.parts["compute"])
            # the prefill samples token 1; token j (2..g) attends ctx + j - 1 tokens
            n, own = s.gen_tokens - 1, ctx - sys_tokens
            if n:
                weight = own + MIN_RATIO * (reserve - 1)
                tot.admission += n * weight
                tot.admission_min = min(tot.admission_min, weight)
                tot.reserve_min = min(tot.reserve_min, reserve)
                tot.private_min = own + 1 if tot.decode == 0 else min(tot.private_min, own + 1)
                tot.steps.append((ctx + 1, n, weight))
            tot.decode += n
            tot.reads += n * ctx + n * (n + 1) // 2
            tot.private_reads += n * own + n * (n + 1) // 2
            tot.squares += n * own * own + own * n * (n + 1) + n * (n + 1) * (2 * n + 1) // 6
            # decode(1, c) is convex in c: n x its value at the mean context is a lower bound
            chain += n * cost.decode(1, ctx + s.gen_tokens // 2) if n else 0.0
            ctx += s.gen_tokens
            if i < len(a.steps) - 1:
                chain += s.tool_seconds
                tools += s.tool_seconds
                tot.tools.append((s.tool_seconds, ctx - sys_tokens, ctx, agent))
                start, ctx = ctx, ctx + s.obs_tokens
        tot.chains.append(chain)
        tot.hidden.append(hidden)
        tot.agent_decode.append(tot.decode - decode)
        tot.agent_reads.append(tot.reads - reads)
        tot.agent_tools.append(tools)
        tot.agent_compute.append(compute)
        tot.agent_slack.append(slack)
        tot.agent_fresh.append(tot.fresh - fresh)
        tot.agent_room.append(room)
        tot.agent_admission.append(tot.admission - admission)
    return tot


def lower_bound(
    workload: Workload,
    deployment: str,
    host_tier: bool = False,
    pcie_bytes_per_s: float | None = None,
    through_runner: bool = True,
    **deployment_overrides: Any,
) -> dict:
    """host_tier: evicted KV can be reloaded from host memory (HiCache, at pcie_bytes_per_s
    per GPU, default the preset's) where that is cheaper than recomputing it; the host
    tier's size is not a constraint here, which only lowers the bound. through_runner: the
    batch runs through the runner (simulate, run.py --engine sim), so the bound is taken
    over the prompts it sends (`Workload.as_sent`: its chat template and tool instructions
    counted exactly, each agent ended where the runner ends it) unless the engine would clip
    a reply; False (or where it would): over the trace's own tokens, as a driver without the
    runner sends them."""
    return lower_bounds(
        workload, deployment, (host_tier,), pcie_bytes_per_s, through_runner, **deployment_overrides
    )[0]


def lower_bounds(
    workload: Workload,
    deployment: str,
    host_tiers: Sequence[bool] = (False, True),
    pcie_bytes_per_s: float | None = None,
    through_runner: bool = True,
    **deployment_overrides: Any,
) -> list[dict]:
    """`lower_bound` for each of `host_tiers`, from one pass over the workload (the prompts
    as sent and the totals are the same for both; only the memory term differs)."""
    dep = sim_deployment(deployment, **deployment_overrides)
    cost = CostModel(dep, pcie_bytes_per_s)
    sent = None
    if through_runner:
        sent = workload.as_sent(dep.max_context, dep.pool_tokens, MAX_NEW_TOKENS)
        workload = sent or workload
    tot = totals(workload, cost, template=workload is not sent)
    sys_tokens, capacity = workload.system_tokens, dep.pool_tokens
    fixed = cost.prefill_fixed  # per prefill iteration: paid once per full chunk here
    chunks = math.ceil(tot.fresh / CHUNK)
    # Prefill as one iteration over every segment (weights read once, one all-reduce
    # latency): no batching of the same work can be cheaper; the fixed launch cost is paid
    # once per chunk of fresh tokens at least.
    batched = cost.prefill(tot.segments, sampled=tot.sampled) if tot.segments else None
    body = batched.seconds - fixed if batched else 0.0
    prefill = body + chunks * fixed
    # Recompute adds compute; where the batched prefill is memory-bound, that much of it
    # could hide under the weight reads, so the memory term starts that much lower.
    slack = max(0.0, batched.parts["memory"] - batched.parts["compute"]) if batched else 0.0
    # The prefill iterations' compute, launches and all-reduces alone: additive over any
    # split of the work, so recomputes add to it in full.
    prefill_compute = (
        batched.parts["compute"] + cost.allreduce(tot.fresh) + chunks * fixed if batched else 0.0
    )
    # Decode in iterations of the whole batch; the per-iteration batch is rounded down so
    # the bound never counts more tokens than were generated.
    gen, reads = tot.decode, tot.reads
    widest = _widest(tot, len(workload.agents), sys_tokens, capacity)
    iters = math.ceil(gen / widest)
    batch = gen // iters if iters else 0
    decode = iters * cost.decode(batch, reads // iters) if iters else 0.0
    # Every request in one decode iteration is resident at once: their contexts (the shared
    # prompt once) fit the pool, so there are at least this many iterations.
    mem_iters = math.ceil(tot.private_reads / max(1, capacity - sys_tokens))
    # An agent has one request at a time and a request decodes one token per iteration, so
    # each agent's decode tokens lie in distinct iterations.
    own_iters = max(tot.agent_decode, default=0)
    min_iters = max(mem_iters, own_iters, _admission_iters(tot, sys_tokens, capacity))
    decode = max(decode, _decode_floor(cost, min_iters, gen, reads, widest))
    engine = prefill + decode
    chain = max(tot.chains, default=0.0)
    longest = sorted(range(len(tot.chains)), key=lambda a: -tot.chains[a])[:SHARED_AGENTS]
    room = _admission_room(tot, sys_tokens, capacity)
    shared = max((_shared_chain_bound(cost, tot, widest, a, room) for a in longest), default=0.0)
    memories = _coupled_memory_bounds(
        cost, tot, widest, sys_tokens, capacity, host_tiers,
        max(engine - slack, prefill_compute), engine, prefill, min_iters,
    )  # fmt: skip
    out = []
    for memory in memories:
        out.append(
            {
                "bound_seconds": round(max(memory, chain, shared), 3),
                "engine_bound_seconds": round(engine, 3),
                "memory_bound_seconds": round(memory, 3),
                "prefill_seconds": round(prefill, 3),
                "decode_seconds": round(decode, 3),
                "longest_chain_seconds": round(chain, 3),
                "shared_chain_seconds": round(shared, 3),
                "decode_iterations_min": max(min_iters, iters),
                "as_sent": workload is sent,
            }
        )
    return out


def _admission_iters(tot: Totals, sys_tokens: int, capacity: int) -> int:
    """Decode iterations the admission rule forces (docs/simulator.md, item 1): a request
    is admitted only while the running ones' contexts, its own, its reserve M and at least
    MIN_RATIO x (M - generated) for each running one fit the pool; so every decode batch has
    sum over its requests of (private prompt + MIN_RATIO (M - 1)) below
    capacity - shared prompt - (1 - MIN_RATIO) x the least M."""
    room = _admission_room(tot, sys_tokens, capacity)
    if tot.decode <= 0 or room <= 0:
        return 0
    return max(0, math.ceil(tot.admission / room))


def _admission_room(tot: Totals, sys_tokens: int, capacity: int) -> float:
    """What one decode batch's admission sum stays below (_admission_iters)."""
    return capacity - sys_tokens - (1 - MIN_RATIO) * tot.reserve_min


def _decode_unit(cost: CostModel) -> tuple[dict[str, float], float, float]:
    """A batch-1 decode's parts with no context, `base` (its weights, all-reduce latency and
    launch) and `k` (seconds to read one context token's KV)."""
    one = cost.decode_parts(1, 0)
    base = one["memory"] + one["allreduce"] + one["overhead"]
    return one, base, cost.decode_parts(1, 1)["memory"] - one["memory"]


def _widest(tot: Totals, agents: int, sys_tokens: int, capacity: int) -> int:
    """The most requests one decode iteration can hold: one per agent, their private
    contexts within the pool, and the admission rule's sum (_admission_iters)."""
    widest = max(1, agents)
    if tot.decode > 0:
        widest = min(widest, max(1, (capacity - sys_tokens) // max(1, tot.private_min)))
        room = _admission_room(tot, sys_tokens, capacity)
        if tot.admission_min > 0:
            widest = min(widest, max(1, math.ceil(room / tot.admission_min)))
    return widest


def _decode_floor(
    cost: CostModel, iters: int, gen_tokens: int, ctx_reads: int, widest: int = 1
) -> float:
    """A floor on `gen_tokens` decoded in `iters` iterations however they are batched: each
    reads at least one token's weights, pays its launch cost and its all-reduce latency;
    across them the KV reads and the FLOPs add up (a sum of maxima is at least the max of
    the sums), and the all-reduce bytes grow linearly with the batch. MoE: a batch of b
    <= `widest` tokens reads w(b) >= w(1) + (b - 1) x the chord of the concave w over
    1..widest, so the iterations read at least iters w(1) + (gen - iters) x chord."""
    if iters <= 0 or gen_tokens <= 0:
        return 0.0
    iters = min(iters, gen_tokens)
    one, _, kv = _decode_unit(cost)
    two = cost.decode_parts(2, 0)
    chord = 0.0
    if widest > 1:
        chord = (cost.decode_parts(widest, 0)["memory"] - one["memory"]) / (widest - 1)
    flops_tok = two["compute"] - one["compute"]
    flops_ctx = cost.decode_parts(1, 1)["compute"] - one["compute"]
    ar_tok = two["allreduce"] - one["allreduce"]
    memory = iters * one["memory"] + chord * (gen_tokens - iters) + kv * ctx_reads
    compute = flops_tok * gen_tokens + flops_ctx * ctx_reads
    allreduce = iters * (one["allreduce"] - ar_tok) + ar_tok * gen_tokens
    return max(memory, compute) + allreduce + iters * one["overhead"]


def _shared_chain_bound(
    cost: CostModel, tot: Totals, widest: int, agent: int, room: float
) -> float:
    """The agent's chain with the GPU it shares (docs/simulator.md, item 2). Iterations
    without it run during its tools or hold it up: T >= own + riding + max(tools, rest),
    where the others' decode tokens either ride in its decode iterations (each adds at
    least mu = the chord of the weights read plus its all-reduce bytes, and k x its
    context) or run in iterations without it (each at least base - mu more). Minimised over
    y, the riding tokens (the y least contexts at best), and over where their prefill runs."""
    g_own = tot.agent_decode[agent]
    if g_own <= 0:
        return tot.chains[agent]
    one, base, k = _decode_unit(cost)
    mu = cost.decode_parts(2, 0)["allreduce"] - one["allreduce"]
    if widest > 1:
        mu += (cost.decode_parts(widest, 0)["memory"] - one["memory"]) / (widest - 1)
    # a batch-1 decode its chain counts at max(compute, memory): riders' reads can hide
    # under that much compute (none on the presets: decode at batch 1 is memory-bound)
    top = max((c + n for c, n, _ in tot.steps), default=1)
    gap = max(
        d["compute"] - d["memory"] for d in (cost.decode_parts(1, 1), cost.decode_parts(1, top))
    )
    hide = max(0.0, gap) * g_own
    g_rest = tot.decode - g_own
    # the others' prefill compute, less what the agent's own prefills leave idle under their
    # weight reads (where it could ride for free)
    prefill = max(0.0, sum(tot.agent_compute) - tot.agent_compute[agent] - tot.agent_slack[agent])
    # and, wherever it runs, its all-reduce bytes (linear in the tokens); the part that does
    # not fit the agent's own prefill iterations needs iterations of its own, each with a
    # launch and an all-reduce latency at least
    fresh = tot.fresh - tot.agent_fresh[agent]
    ar_tok = cost.allreduce(2) - cost.allreduce(1)
    launches = math.ceil(max(0, fresh - tot.agent_room[agent]) / CHUNK)
    prefill += ar_tok * fresh + launches * (cost.prefill_fixed + cost.allreduce(1) - ar_tok)
    # ride + rest: every other token's mu and reads wherever it runs (less what hides under
    # the agent's own compute), the prefill, and base - mu per iteration without the agent
    rest_fixed = g_rest * mu + k * (tot.reads - tot.agent_reads[agent]) + prefill - hide
    least_reads = _least_sum([(c, n) for c, n, _ in tot.steps])
    most_weight = _least_sum([(-w, n) for _, n, w in tot.steps])
    weight_rest = tot.admission - tot.agent_admission[agent]

    def riding(y: int) -> float:
        return tot.agent_tools[agent] + max(0.0, y * mu + k * least_reads(y) - hide)

    def rest(y: int) -> float:
        """The others' work without the agent: its iterations hold at most `widest`
        requests, and the admission rule's sum (_admission_iters) of the tokens not riding."""
        iters = math.ceil((g_rest - y) / widest)
        if room > 0:
            iters = max(iters, math.ceil((weight_rest + most_weight(y)) / room))
        return rest_fixed + (base - mu) * iters

    lo, hi = 0, min(g_rest, (widest - 1) * g_own)
    while lo < hi:  # riding grows with y, rest shrinks: the least max is where they cross
        mid = (lo + hi) // 2
        if riding(mid) >= rest(mid):
            hi = mid
        else:
            lo = mid + 1
    best = min(max(riding(y), rest(y)) for y in {lo, max(0, lo - 1)})
    own = tot.chains[agent] - tot.agent_tools[agent]
    return own + best


def _least_sum(values: list[tuple[float, int]]) -> Callable[[int], float]:
    """y -> the sum of the y least of a multiset given as (value, count) pairs."""
    values = sorted(values)
    counts = list(accumulate(n for _, n in values))
    sums = list(accumulate(v * n for v, n in values))

    def least(y: int) -> float:
        i = bisect_left(counts, y)
        if i >= len(values):
            return float(sums[-1]) if sums else 0.0
        before = counts[i - 1] if i else 0
        return (sums[i - 1] if i else 0.0) + (y - before) * values[i][0]

    return least


def _coupled_memory_bounds(
    cost: CostModel,
    tot: Totals,
    agents: int,
    sys_tokens: int,
    capacity: int,
    host_tiers: Sequence[bool],
    engine: float,
    floor: float,
    prefill: float = 0.0,
    min_iters: int = 0,
) -> list[float]:
    """The memory bound for each of `host_tiers` (all but the reloads shared), coupled to N, the
    decode iterations. Each lasts at least base + k x C (one token's weights, launch and
    all-reduce latency, plus reading the C context tokens of its requests) while those contexts
    are resident, so (C' = C without the shared prompt) their residency is >= sum C' (base + k
    C) >= base R' + k (max(Q, R'^2 / N) + sys R'); and the N iterations take >= N base + k R +
    the extra weights and all-reduce bytes of batching, in the time the prefill iterations (>=
    `prefill` seconds) leave, so a run of T seconds has N <= N(T); N >= `min_iters` (the pool,
    admission). `engine` is the work the drops' recompute adds to, `floor` a bound already
    proven (docs/simulator.md)."""
    one, base, k = _decode_unit(cost)
    # batching: a token beyond the first adds at least the chord of the (concave) expert
    # weights read over 1..agents (the widest batch), and its all-reduce bytes
    wide = cost.decode_parts(max(2, agents), 0)["memory"]
    per_tok = (wide - one["memory"]) / max(1, agents - 1)
    per_tok += cost.decode_parts(2, 0)["allreduce"] - one["allreduce"]
    rp, g = tot.private_reads, tot.decode
    fixed_part = prefill + g * per_tok + k * tot.reads
    slope = base - per_tok  # >= 0: w(agents) <= agents x w(1) for concave w, w(0) >= 0
    # at most `agents` requests per iteration, and their contexts fit the pool
    lo = max(1.0, g / max(1, agents), rp / max(1, capacity - sys_tokens), float(min_iters))

    def held(t: float) -> float | None:
        """Decode residency of a run of t seconds (None: too short for its iterations)."""
        if g <= 0:
            return 0.0
        n = float(g) if slope <= 0 else min(float(g), (t - fixed_part) / slope)
        if n < lo:
            return None
        return base * rp + k * (max(tot.squares, rp * rp / n) + sys_tokens * rp)

    items = _drop_items(cost, tot, sys_tokens)
    fill = _fill(tot.growth, capacity, cost.prefill_linear_per_token)
    return [
        _memory_bound(
            floor,
            engine,
            held,
            items,
            capacity,
            tot.chains,
            tot.hidden,
            cost.host_load(1) if host_tier else None,
            fill,
        )
        for host_tier in host_tiers
    ]


def _fill(
    growth: Sequence[tuple[float, int]], capacity: int, per_token: float
) -> Callable[[float], float]:
    """t -> the most token-seconds of private context the memory term can count in [0, t]
    (docs/simulator.md, item 3, *Filling the pool*). At time s the pool holds at most
    `capacity`; an agent holds at most the context of the furthest step its chain can
    have reached by s (`growth`); and every resident token was computed by then, in
    iterations that each take at least `per_token` (its linear layers' FLOPs) per token
    they compute, so at most s / per_token of them."""
    times, levels = [0.0], [0]
    for t, n in sorted(growth):
        if t > times[-1]:
            times.append(t)
            levels.append(levels[-1])
        levels[-1] += n

    def area(t0: float, t1: float, level: int) -> float:
        """The integral of min(level, capacity, s / per_token) over s in [t0, t1]."""
        c = min(level, capacity)
        if per_token <= 0:
            return c * (t1 - t0)
        x = min(max(c * per_token, t0), t1)  # where s / per_token reaches c
        return (x * x - t0 * t0) / (2 * per_token) + c * (t1 - x)

    done = [0.0]
    for i in range(1, len(times)):
        done.append(done[-1] + area(times[i - 1], times[i], levels[i - 1]))

    def room(t: float) -> float:
        i = bisect_right(times, t) - 1
        return done[i] + area(times[i], t, levels[i]) if t > 0 else 0.0

    return room


def _drop_items(
    cost: CostModel, tot: Totals, sys_tokens: int
) -> list[tuple[float, float, int, int]]:
    """(tool seconds, seconds per dropped token, tokens, agent) per tool wait. Eviction takes
    leaves, so what an agent loses is a suffix of its context: recomputing x of its n tokens costs
    their linear FLOPs and attention over positions n - x .. n - 1, on average at least
    (n + shared prompt) / 2 keys each (x <= n - shared)."""
    lin = cost.prefill_linear_per_token
    # one more token at position 1: its linear FLOPs and 2 more (query, key) pairs
    two = cost.prefill([(0, 2)]).parts["compute"] - cost.prefill([(0, 1)]).parts["compute"]
    pair = (two - lin) / 2
    out = []
    for t, n, whole, agent in tot.tools:
        per = lin + pair * (whole + sys_tokens) / 2
        out.append((t, per, n, agent))
    return out


def _memory_bound(
    floor: float,
    engine: float,
    held: Callable[[float], float | None],
    items: list[tuple[float, float, int, int]],
    capacity: int,
    chains: Sequence[float] = (),
    hidden: Sequence[float] = (),
    reload: float | None = None,
    fill: Callable[[float], float] | None = None,
) -> float:
    """The least T >= floor at which the memory fits: fill(T) (default capacity x T: the
    pool's token-seconds, or what of them a run can fill, _fill) >= held(T) + the tools'
    residency - what drops save, where the drops' recompute fits both the engine
    (engine + cost <= T) and each agent's own chain (its drops cost it at least their
    recompute less what its prefills hide: chains[a] + cost_a - hidden[a] <= T; agent -1:
    no chain). `reload`: seconds of PCIe per token reloaded from a host tier (None: none).
    A reload may hide entirely under the forward that waits for it, so it costs neither
    budget, but a run of T seconds reloads at most T / reload tokens: what reloads can save
    is at most the token-seconds of the longest tools' T / reload tokens, and what they
    leave the recompute greedy must save (counting a token in both only lowers the bound).
    Feasibility only grows with T, so bisection; the answer is the largest T shown
    infeasible (or floor), hence a lower bound."""
    if capacity <= 0:
        return math.inf
    tools = sum(t * n for t, _, n, _ in items)
    dear = math.inf  # a token held through no tool saves nothing
    order = sorted(items, key=lambda it: it[1] / it[0] if it[0] > 0 else dear)
    longest = sorted(((sec, n) for sec, _, n, _ in items if sec > 0), reverse=True)

    def reloaded(t: float) -> float:
        """Token-seconds that reloads can save in a run of t seconds: at most."""
        if reload is None:
            return 0.0
        left, saved = (math.inf if reload <= 0 else t / reload), 0.0
        for sec, n in longest:
            if left <= 0:
                break
            x = min(n, left)
            saved, left = saved + x * sec, left - x
        return saved

    def fits(t: float) -> bool:
        h = held(t)
        if h is None or engine > t:
            return False
        # token-seconds the drops must save
        need = h + tools - (capacity * t if fill is None else fill(t)) - reloaded(t)
        budget = t - engine
        left = [t - c + hidden[a] for a, c in enumerate(chains)]
        for sec, per, n, agent in order:
            if need <= 0 or budget <= 0 or sec <= 0:
                break
            room = budget if agent < 0 else min(budget, left[agent])
            x = n if per <= 0 else min(n, room / per)
            if x <= 0:
                continue
            if x * sec >= need:  # a part of this item is enough
                return True
            need -= x * sec
            budget -= x * per
            if agent >= 0:
                left[agent] -= x * per
        return need <= 0

    if fits(floor):
        return floor
    lo, hi = floor, max(2 * floor, 1e-6)
    while not fits(hi):
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo
