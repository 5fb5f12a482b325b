"""The oracle lower bound: hand-computed memory trades, and never above a simulated run."""

import pytest

from runner.policies.registry import make_policy
from runner.sim.oracle import CHUNK, _memory_bound, _prefill_room, lower_bound, lower_bounds
from runner.sim.simulate import simulate
from runner.sim.workload import synthetic


def _mb(engine, held, items, capacity, chains=(), hidden=()):
    return _memory_bound(engine, engine, lambda t: held, items, capacity, chains, hidden)


def test_memory_bound_without_pressure_is_the_engine_bound():
    # 100 tokens held through a 5 s tool fit a 100-token pool in 5 s < 10 s of engine work
    assert _mb(10.0, 0.0, [(5.0, 0.01, 100, -1)], 100) == 10.0


def test_memory_bound_drops_part_of_a_context():
    # 1000 token-s on a 50-token pool = 20 s. Dropping x tokens costs 0.01 x s and saves
    # 10 x token-s: 1 + 0.01 x = (1000 - 10 x) / 50  ->  x = 19 / 0.21
    got = _mb(1.0, 0.0, [(10.0, 0.01, 100, -1)], 50)
    assert got == pytest.approx(1.0 + 0.01 * 19 / 0.21)


def test_memory_bound_drops_the_cheapest_token_seconds_first():
    # 50 tokens through a 10 s tool go first (all of them: 0.5 s), then 100/3 x 1 s ones
    got = _mb(1.0, 0.0, [(1.0, 0.01, 100, -1), (10.0, 0.01, 50, -1)], 50)
    assert got == pytest.approx(1.5 + 0.01 * (2.0 - 1.5) / 0.03)
    # the same tokens dearer to recompute in the long tool (attention at a long context):
    # 0.25 s per token-s there against 0.01 in the short one, so the short one goes first
    got = _mb(1.0, 0.0, [(1.0, 0.01, 100, -1), (10.0, 2.5, 50, -1)], 50)
    # all 100 short ones (1 s, 100 token-s), then x long: 2 + 2.5 x = (500 - 10 x) / 50
    assert got == pytest.approx(2.0 + 2.5 * 8.0 / 2.7)


def test_memory_bound_counts_generation_residency():
    # nothing to drop: 400 token-s held while generating, on a 100-token pool
    assert _mb(1.0, 400.0, [], 100) == pytest.approx(4.0)


def test_an_agent_cannot_drop_more_than_its_own_chain_allows():
    # the same drop as above, but its recompute lands on the agent's own chain: with a 1.5 s
    # chain and 0.1 s hidden under its prefills' weight reads it may spend T - 1.4 s
    free = _mb(1.0, 0.0, [(10.0, 0.01, 100, -1)], 50)
    own = _mb(1.0, 0.0, [(10.0, 0.01, 100, 0)], 50, chains=[1.5], hidden=[0.1])
    assert own > free
    # at T the agent spends T - 1.4 s: (1000 - 10 (T - 1.4) / 0.01) / 50 = T
    assert own == pytest.approx((1000 + 1400) / 1050, rel=1e-6)
    # an agent with room to spare drops as freely as no chain at all
    roomy = _mb(1.0, 0.0, [(10.0, 0.01, 100, 0)], 50, chains=[0.0], hidden=[10.0])
    assert roomy == pytest.approx(free, rel=1e-6)


PRESSURED = dict(final=(3000, 6000), gen=(30, 60))


@pytest.mark.parametrize("policy", ["none", "aimd", "agent-cap:2"])
def test_bound_never_exceeds_a_simulated_run(tmp_path, policy):
    w = synthetic("tiny", seed=3, **PRESSURED)
    opts = {"max_total_tokens": 9000}  # the 8 agents' final contexts do not fit at once
    b = lower_bound(w, "tiny-cpu", **opts)
    assert b["memory_bound_seconds"] >= b["engine_bound_seconds"]
    assert b["bound_seconds"] == max(b["memory_bound_seconds"], b["longest_chain_seconds"])
    r = simulate(w, "tiny-cpu", make_policy(policy), tmp_path / "r", engine_options=opts)
    assert r.sim_seconds >= b["bound_seconds"]
    # a host tier can only lower the bound; the hicache run still respects its own
    bh = lower_bound(w, "tiny-cpu", host_tier=True, **opts)
    assert bh["bound_seconds"] <= b["bound_seconds"]
    rh = simulate(
        w,
        "tiny-cpu",
        make_policy(policy),
        tmp_path / "h",
        engine_options={**opts, "hicache_ratio": 2.0},
    )
    assert rh.sim_seconds >= bh["bound_seconds"]


def test_memory_term_binds_on_a_small_pool():
    w = synthetic("tiny", seed=3, **PRESSURED)
    roomy = lower_bound(w, "tiny-cpu", max_total_tokens=100_000)
    tight = lower_bound(w, "tiny-cpu", max_total_tokens=4000)
    # on the roomy pool only the agents' own growth limits what it can hold (_fill): the
    # memory term is above the engine term there but no further than their chains
    assert roomy["memory_bound_seconds"] <= roomy["longest_chain_seconds"]
    assert tight["memory_bound_seconds"] > tight["engine_bound_seconds"]
    assert tight["memory_bound_seconds"] > 1.4 * roomy["memory_bound_seconds"]


def test_a_slow_host_tier_never_raises_the_bound_above_recompute():
    # reloads slower than recomputing: the bound falls back to the recompute floor
    w = synthetic("tiny", seed=3, **PRESSURED)
    opts = {"max_total_tokens": 4000}
    plain = lower_bound(w, "tiny-cpu", **opts)
    slow = lower_bound(w, "tiny-cpu", host_tier=True, pcie_bytes_per_s=1.0, **opts)
    fast = lower_bound(w, "tiny-cpu", host_tier=True, pcie_bytes_per_s=1e15, **opts)
    assert slow["memory_bound_seconds"] == plain["memory_bound_seconds"]
    assert fast["memory_bound_seconds"] < plain["memory_bound_seconds"]


def test_decode_floor_grows_with_the_iterations_and_matches_one_iteration_by_hand():
    from runner.sim.engine import CostModel
    from runner.sim.engine import deployment as dep
    from runner.sim.oracle import _decode_floor

    cost = CostModel(dep("qwen3-32b-tp8"))
    # one iteration of 4 tokens over 4,000 context tokens: the cost model's own figure
    assert _decode_floor(cost, 1, 4, 4000) == pytest.approx(cost.decode(4, 4000))
    # more iterations for the same tokens cost more (weights, launches, latencies again)
    assert _decode_floor(cost, 10, 40, 40_000) > _decode_floor(cost, 5, 40, 40_000)
    # ten equal iterations: exactly ten times one of them
    assert _decode_floor(cost, 10, 40, 40_000) == pytest.approx(10 * cost.decode(4, 4000))


@pytest.mark.parametrize("policy", ["none", "aimd", "wset", "agent-cap:3"])
def test_pool_limited_decode_binds_and_stays_below_simulated_runs(tmp_path, policy):
    # a pool that holds few contexts: decode batches are small, so the bound counts more
    # decode iterations than the batch of all agents would need
    w = synthetic("tiny", seed=3, **PRESSURED)
    opts = {"max_total_tokens": 7000}
    b = lower_bound(w, "tiny-cpu", **opts)
    roomy = lower_bound(w, "tiny-cpu", max_total_tokens=100_000)
    assert b["decode_seconds"] > roomy["decode_seconds"]
    r = simulate(w, "tiny-cpu", make_policy(policy), tmp_path / "r", engine_options=opts)
    assert r.sim_seconds >= b["bound_seconds"]


# The validity check of every term: random small workloads (fixed seeds) on pools from roomy
# to far too small, with slow tools, spikes and shared prompts, under every policy, on the
# device alone and with a host tier; no run may finish before its bound.
POLICIES = ["none", "aimd", "wset", "agent-cap:2", "request-cap:2"]


def _random_case(seed: int) -> tuple[dict, dict, str]:
    import random

    rng = random.Random(seed)
    if seed % 2:  # pressured: contexts that do not fit the pool together, long decodes
        lo = rng.randint(1500, 4000)
        shape = dict(
            agents=rng.randint(4, 12),
            steps=(2, rng.randint(3, 7)),
            final=(lo, lo + rng.randint(0, 3000)),
            gen=(rng.randint(10, 40), rng.randint(40, 120)),
            tool_s=(rng.choice([0.01, 0.1]), rng.choice([0.2, 1.0, 4.0])),
        )
        pool = rng.choice([5_000, 7_000, 10_000])
    else:
        lo = rng.randint(150, 1500)
        shape = dict(
            agents=rng.randint(1, 12),
            steps=(1, rng.randint(2, 8)),
            final=(lo, lo + rng.randint(0, 3000)),
            gen=(rng.randint(1, 10), rng.randint(10, 60)),
            tool_s=(rng.choice([0.01, 0.05, 0.5]), rng.choice([0.5, 3.0, 20.0])),
        )
        pool = rng.choice([4_000, 8_000, 20_000, 100_000])
    shape.update(start=rng.randint(16, 200), system=rng.choice([0, 16, 500, 2000]))
    if rng.random() < 0.3:
        shape["slow_tools"] = (0.3, 10.0, 40.0)
    if rng.random() < 0.3:
        shape["spikes"] = (0.2, 1000, 3000)
        shape["max_context"] = 12_000
    # the cost model of a real deployment (decode and prefill dear next to the tools) or
    # of the fake one (tools dominate)
    dep = rng.choice(["tiny-cpu", "qwen3-32b-tp2", "qwen3-32b-tp8", "deepseek-v3-tp16"])
    return shape, {"max_total_tokens": pool}, dep


@pytest.mark.parametrize("seed", range(12))
def test_bound_never_exceeds_any_policy_on_random_workloads(tmp_path, seed):
    shape, opts, dep = _random_case(seed)
    w = synthetic("tiny", seed=seed, **shape)
    biggest = max(a.total_tokens() for a in w.agents) + w.system_tokens
    if biggest + 300 > opts["max_total_tokens"]:  # one agent must fit, templates and all
        opts["max_total_tokens"] = 2 * biggest + 1000
    b = lower_bound(w, dep, **opts)
    bh = lower_bound(w, dep, host_tier=True, **opts)
    assert bh["bound_seconds"] <= b["bound_seconds"]
    for policy in POLICIES:
        for host in (False, True):
            engine = {**opts, "hicache_ratio": 2.0} if host else opts
            r = simulate(w, dep, make_policy(policy), tmp_path / "r", engine_options=engine)
            assert r.by_status == {"submitted": len(w.agents)}  # all the work, done
            bound = (bh if host else b)["bound_seconds"]
            assert r.sim_seconds >= bound, (policy, host, r.sim_seconds, b, bh)


def test_template_tokens_stay_within_the_oracle_allowance(tmp_path):
    # the admission term credits the reserve min(max_new, 4096) only where the engine's clip
    # to min(context, pool) - 2 - prompt cannot bind, allowing TEMPLATE_ONCE +
    # TEMPLATE_PER_TURN x steps runner tokens on top of the workload's own: measured here on
    # the real runner's prompts (~220 + ~21 per step)
    from runner.sim.oracle import TEMPLATE_ONCE, TEMPLATE_PER_TURN

    w = synthetic("tiny", seed=5, agents=8, steps=(1, 12), system=16)
    r = simulate(w, "tiny-cpu", make_policy("none"), tmp_path / "r")
    for a in w.agents:
        steps, final, _ = r.work[a.id]
        assert steps == len(a.steps)
        overhead = final - (w.system_tokens + a.total_tokens())
        assert 0 < overhead <= TEMPLATE_ONCE + TEMPLATE_PER_TURN * len(a.steps), (a.id, overhead)


@pytest.mark.parametrize("policy", ["none", "agent-cap:40"])
def test_admission_reserve_limits_decode_batches_as_the_bound_says(tmp_path, policy):
    # 40 agents of ~1,700-token contexts with near-instant tools on a 40K pool: the contexts
    # alone fit 23 at once, but each admission needs its own 4,096-token reserve free beyond
    # the running requests' contexts and >= 0.098 x their reserves (~400 each), so a decode
    # batch holds at most ~17: the bound's least decode iterations follow the reserve
    from runner.sim.oracle import MIN_RATIO

    w = synthetic(
        "tiny", seed=7, agents=40, steps=(4, 6), final=(1600, 1800), gen=(20, 30),
        start=1500, system=16, tool_s=(0.01, 0.02),
    )  # fmt: skip
    opts = {"max_total_tokens": 40_000}
    b = lower_bound(w, "tiny-cpu", **opts)
    reads = sum(
        (s.gen_tokens - 1) * (a.prompt_tokens + s.gen_tokens) for a in w.agents for s in a.steps
    )
    assert b["decode_iterations_min"] > 1.1 * reads / (40_000 - w.system_tokens)  # not the pool
    r = simulate(w, "tiny-cpu", make_policy(policy), tmp_path / "r", engine_options=opts)
    assert r.sim_seconds >= b["bound_seconds"]
    assert r.engine["retractions"] == 0  # the term's assumption holds here
    assert r.engine["decode_iterations"] >= b["decode_iterations_min"]
    # at the edge: the engine's widest batch is what the reserve allows for the workload's
    # shortest prompt, no more; the real prompts carry ~300 template tokens more and grow to
    # ~1,800, so the engine reaches about 2/3 of it
    room = 40_000 - w.system_tokens - (1 - MIN_RATIO) * 4096
    widest = room / min(a.prompt_tokens + MIN_RATIO * (4096 - 1) for a in w.agents)
    assert 0.6 * widest <= r.engine["max_running"] <= widest


def test_decode_iterations_share_the_run_with_the_prefill(tmp_path):
    # the coupled memory term now leaves the decode iterations only the time the prefill
    # does not take: on a pool far too small for the contexts it rises above the engine
    # term, and simulated runs stay above it
    w = synthetic("tiny", seed=3, **PRESSURED)
    opts = {"max_total_tokens": 7000}
    b = lower_bound(w, "qwen3-32b-tp2", **opts)
    assert b["memory_bound_seconds"] > b["engine_bound_seconds"]
    for policy in ("none", "wset"):
        r = simulate(w, "qwen3-32b-tp2", make_policy(policy), tmp_path / policy,
                     engine_options=opts)  # fmt: skip
        assert r.sim_seconds >= b["bound_seconds"], (policy, r.sim_seconds, b)


@pytest.mark.parametrize(
    "seed,dep", [(2, "qwen3-32b-tp8"), (2, "tiny-cpu"), (1, "deepseek-v3-tp16")]
)
def test_shared_chain_binds_where_the_others_outlast_the_longest_agents_tools(tmp_path, seed, dep):
    # near-instant tools: the other agents' work cannot hide in the longest agent's tools,
    # so it either rides in that agent's decode iterations (lengthening them) or holds the
    # agent up; the bound then sits above both its chain and the engine term (over the
    # trace's own tokens: the runner's template tokens raise the engine term to meet it)
    w = synthetic(
        "tiny", seed=seed, agents=12, steps=(3, 5), long_steps=(0.1, 40, 50),
        tool_s=(0.01, 0.05), gen=(20, 60), final=(1000, 3000),
    )  # fmt: skip
    opts = {"max_total_tokens": 100_000}
    b = lower_bound(w, dep, through_runner=False, **opts)
    assert b["shared_chain_seconds"] > b["longest_chain_seconds"]
    assert b["shared_chain_seconds"] > b["memory_bound_seconds"]
    assert b["bound_seconds"] == b["shared_chain_seconds"]
    sent = lower_bound(w, dep, **opts)
    assert sent["as_sent"] and sent["bound_seconds"] >= b["bound_seconds"]
    for policy in ("none", "aimd", "agent-cap:2"):
        r = simulate(w, dep, make_policy(policy), tmp_path / policy, engine_options=opts)
        assert r.sim_seconds >= sent["bound_seconds"], (policy, r.sim_seconds, sent)


@pytest.mark.parametrize("policy", ["none", "agent-cap:3"])
def test_each_agents_decode_tokens_take_iterations_of_their_own(tmp_path, policy):
    # one agent generates far more than the rest: a request decodes one token per iteration
    # and an agent has one request at a time, so the run needs at least that agent's decode
    # tokens in iterations, more than the tokens over the batch width would say
    w = synthetic(
        "tiny", seed=4, agents=6, steps=(1, 2), long_steps=(0.2, 6, 8), gen=(20, 200),
        tool_s=(0.01, 0.05), final=(400, 900),
    )  # fmt: skip
    own = max(sum(s.gen_tokens - 1 for s in a.steps) for a in w.agents)
    total = sum(s.gen_tokens - 1 for a in w.agents for s in a.steps)
    assert own > total / len(w.agents)
    b = lower_bound(w, "qwen3-32b-tp8", max_total_tokens=100_000)
    assert b["decode_iterations_min"] == own
    r = simulate(w, "qwen3-32b-tp8", make_policy(policy), tmp_path / "r",
                 engine_options={"max_total_tokens": 100_000})  # fmt: skip
    assert r.engine["decode_iterations"] >= own
    assert r.sim_seconds >= b["bound_seconds"]


@pytest.mark.parametrize("policy", ["none", "aimd", "wset"])
def test_shared_chain_charges_the_others_prefill_all_reduce_and_launches(tmp_path, policy):
    # prefill-heavy agents (8-14K contexts, 5-15 tokens a step) with near-instant tools on
    # TP2: the others' prefill cannot hide in the longest agent's tools, and besides its
    # compute it moves its tokens' all-reduce bytes (~7% of it at TP2) and needs a launch
    # per 8,192 tokens beyond what the longest agent's own prefill iterations can hold; with
    # them the shared chain is the batched prefill's equal (compute alone left it ~7% below
    # the engine term), and no run beats it
    w = synthetic(
        "tiny", seed=0, agents=40, steps=(3, 5), long_steps=(0.05, 20, 25),
        final=(8000, 14000), gen=(5, 15), tool_s=(0.05, 0.2), system=16,
    )  # fmt: skip
    opts = {"max_total_tokens": 400_000}
    b = lower_bound(w, "qwen3-32b-tp2", **opts)
    assert b["shared_chain_seconds"] >= 0.99 * b["engine_bound_seconds"]
    assert b["shared_chain_seconds"] > 3 * b["longest_chain_seconds"]
    r = simulate(w, "qwen3-32b-tp2", make_policy(policy), tmp_path / "r", engine_options=opts)
    assert r.engine["retractions"] == 0
    assert r.sim_seconds >= b["bound_seconds"], (r.sim_seconds, b)


def test_prefill_room_counts_a_truncated_continuation():
    """Others' tokens fit only beside a request's first and last chunk; the pool may truncate
    its continuations (then nothing fits after them), so however many tokens it prefills the
    room is 2 chunks less a token at each end."""
    assert _prefill_room(0) == 0
    assert _prefill_room(1) == CHUNK - 1  # one token is one chunk
    assert _prefill_room(2) == _prefill_room(500) == 2 * CHUNK - 2
    assert _prefill_room(5 * CHUNK - 100) == 2 * CHUNK - 2


def test_fill_integrates_the_pool_its_agents_and_the_compute_can_hold_by_hand():
    from runner.sim.oracle import _fill

    # one agent may hold 100 more tokens from 1 s on, another 50, a third 100 from 3 s; a
    # 200-token pool; 0.01 s per token computed, so by s at most 100 s tokens exist
    fill = _fill([(3.0, 100), (1.0, 100), (1.0, 50)], 200, 0.01)
    assert fill(0.5) == fill(1.0) == 0.0  # nothing may be held before 1 s
    assert fill(1.5) == pytest.approx((1.5**2 - 1.0) / 0.02)  # compute-bound: 100 s
    assert fill(3.0) == pytest.approx(62.5 + 150 * 1.5)  # the agents' 150 from 1.5 s
    assert fill(4.0) == pytest.approx(287.5 + 200)  # 250 may be held, the pool is 200
    # with neither limit it is the pool's token-seconds
    assert _fill([(0.0, 10**9)], 200, 0.0)(4.0) == pytest.approx(800.0)


@pytest.mark.parametrize("policy", ["none", "aimd", "wset", "wset2", "agent-cap:4"])
def test_filling_the_pool_raises_the_memory_term_and_stays_below_runs(
    tmp_path, monkeypatch, policy
):
    # 8 agents start at 64 tokens and grow to 8-10K on a 20K pool: no run can hold the
    # pool's worth of contexts before the agents' chains have gone a few steps, so the pool's
    # first seconds count for less than capacity x time
    import runner.sim.oracle as oracle

    w = synthetic(
        "tiny", seed=1, agents=8, steps=(6, 8), start=64, final=(8000, 10000),
        gen=(20, 40), tool_s=(0.5, 2.0), system=0,
    )  # fmt: skip
    opts = {"max_total_tokens": 20_000}
    b = lower_bound(w, "qwen3-32b-tp2", **opts)
    with monkeypatch.context() as m:  # the pool's whole token-seconds from t = 0
        m.setattr(oracle, "_fill", lambda growth, capacity, per: lambda t: capacity * t)
        whole = lower_bound(w, "qwen3-32b-tp2", **opts)
    assert b["memory_bound_seconds"] > 1.03 * whole["memory_bound_seconds"]
    assert b["bound_seconds"] == b["memory_bound_seconds"]  # and it binds
    r = simulate(w, "qwen3-32b-tp2", make_policy(policy), tmp_path / "r", engine_options=opts)
    assert r.engine["retractions"] == 0
    assert r.sim_seconds >= b["bound_seconds"], (r.sim_seconds, b)


def test_lower_bounds_gives_each_tier_as_lower_bound_does():
    w = synthetic("tiny", seed=3, **PRESSURED)
    opts = {"max_total_tokens": 7000}
    device, host = lower_bounds(w, "qwen3-32b-tp2", **opts)
    assert device == lower_bound(w, "qwen3-32b-tp2", **opts)
    assert host == lower_bound(w, "qwen3-32b-tp2", host_tier=True, **opts)
