import pytest

from runner.policies.aimd import AIMD
from runner.policies.baselines import AgentCap, NoGate, RequestCap
from runner.policies.experimental.wset import WorkingSet
from runner.policies.protocol import ContextList, Signals
from runner.policies.registry import make_policy


def sig(window, usage, hit, unfinished=100, **kw):
    base = dict(
        now=0.0,
        window=window,
        usage=usage,
        hit_rate=hit,
        active=window,
        paused=0,
        pending=0,
        finished=0,
        unfinished=unfinished,
    )
    base.update(kw)
    return Signals(**base)


def test_paper_worked_example():
    p = AIMD()
    d1 = p.update(sig(4, 0.65, 0.15))
    assert (d1.window, d1.branch) == (2, "decrease")
    d2 = p.update(sig(d1.window, 0.45, 0.82))
    assert (d2.window, d2.branch) == (2, "hold")
    d3 = p.update(sig(d2.window, 0.18, 0.9))
    assert (d3.window, d3.branch) == (4, "increase")


@pytest.mark.parametrize(
    "u,h,expected",
    [
        (0.1, 0.0, 12),  # U < U_low: grow by alpha whatever H is
        (0.3, 0.0, 10),  # between the thresholds: hold
        (0.6, 0.5, 10),  # above U_high but H healthy: hold
        (0.6, 0.1, 5),  # above U_high and H low: floor(10 * 0.5)
        (0.5, 0.1, 10),  # U == U_high is not above it
        (0.2, 0.1, 10),  # U == U_low is not below it
        (0.9, None, 10),  # no request finished: no evidence, no cut
    ],
)
def test_each_branch(u, h, expected):
    assert AIMD().update(sig(10, u, h)).window == expected


def test_floor_and_lower_bound():
    p = AIMD(beta=0.5)
    assert p.update(sig(3, 0.9, 0.0)).window == 1  # floor(1.5)
    assert p.update(sig(1, 0.9, 0.0)).window == 1  # never below 1
    assert AIMD(beta=0.1).update(sig(5, 0.9, 0.0)).window == 1  # floor(0.5) -> 1


def test_unknown_usage_holds():
    d = AIMD().update(sig(7, None, 0.0))
    assert d.window == 7 and d.branch.startswith("hold")


def test_initial_window():
    assert AIMD().initial_window(100) == 4
    assert AIMD(initial=9).initial_window(100) == 9
    assert AIMD(initial=9).initial_window(3) == 3
    assert AIMD().initial_window(0) == 1


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"beta": 1.0}, "beta"),
        ({"beta": 0.0}, "beta"),
        ({"beta": -0.5}, "beta"),
        ({"u_low": 0.5, "u_high": 0.5}, "u-low"),
        ({"u_low": 0.6, "u_high": 0.5}, "u-low"),
        ({"alpha": 0}, "alpha"),
        ({"h_thresh": 1.5}, "h-thresh"),
        ({"initial": 0}, "initial-window"),
    ],
)
def test_bad_values_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AIMD(**kw)


def test_registry():
    assert isinstance(make_policy("aimd", alpha=3), AIMD)
    assert make_policy("aimd", alpha=3).alpha == 3
    assert isinstance(make_policy("none"), NoGate)
    cap = make_policy("agent-cap:32")
    assert isinstance(cap, AgentCap) and cap.n == 32 and cap.unit == "agent"
    rc = make_policy("request-cap:8")
    assert isinstance(rc, RequestCap) and rc.n == 8 and rc.unit == "request"
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        make_policy("lru")
    with pytest.raises(ValueError, match="agent-cap:<n>"):
        make_policy("agent-cap")
    with pytest.raises(ValueError, match="N >= 1"):
        make_policy("request-cap:0")


def test_fixed_policies():
    assert NoGate().update(sig(5, 0.9, 0.0, unfinished=42)).window == 42
    assert AgentCap(30).update(sig(5, 0.9, 0.0)).window == 30
    assert RequestCap(4).update(sig(9, 0.0, 1.0)).window == 4


# ---- wset: working-set admission -------------------------------------------------------


def ws_sig(held, waiting, capacity=10_000, window=None, **kw):
    base = dict(
        capacity_tokens=capacity,
        contexts=ContextList(tuple(held), tuple(waiting)),
        growth_per_step=0.0,
    )
    base.update(kw)
    return sig(window or len(held), 0.3, 0.9, **base)


def test_wset_opens_wide_while_contexts_are_short():
    # warmup: 50 agents of 150 tokens fit a 10K pool at once; AIMD would add 2 a period
    d = WorkingSet().update(ws_sig([], [150] * 50))
    assert (d.window, d.branch) == (50, "fit")


def test_wset_burst_that_would_overflow_closes_the_window():
    # four agents resident; one just appended a huge observation: only three still fit
    calm = WorkingSet().update(ws_sig([2000, 2000, 2000, 2000], []))
    assert calm.window == 4
    burst = WorkingSet().update(ws_sig([2000, 2000, 2000, 6000], []))
    assert burst.window == 3


def test_wset_counts_growth_and_the_shared_prefix_once():
    p = WorkingSet(target=1.0, headroom_steps=2.0)
    # 10 agents of 1,000 tokens, 900 of which are the shared system prompt
    assert p.update(ws_sig([1000] * 10, [], capacity=2000, shared_tokens=900)).window == 10
    # without the sharing estimate they would not fit
    assert p.update(ws_sig([1000] * 10, [], capacity=2000)).window == 2
    # growth of 200 tokens a step, two steps of headroom each: 900 + 10 x (100 + 400) > 2000
    grown = ws_sig([1000] * 10, [], capacity=2000, shared_tokens=900, growth_per_step=200.0)
    assert p.update(grown).window == 2


def test_wset_keeps_resident_agents_before_waiting_ones():
    # a resident long prefix is expensive to lose: holders are counted first, so a waiting
    # short agent is admitted only if it fits beside them
    p = WorkingSet(target=1.0)
    assert p.update(ws_sig([8000], [1500, 1500], capacity=10_000)).window == 2
    assert p.update(ws_sig([8000], [2500], capacity=10_000)).window == 1


def test_wset_tool_heavy_phase_counts_agents_in_tools():
    # agents in tools send nothing (U is low) but their prefixes must stay resident: the
    # window stays at what fits, it does not grow because U is low
    s = ws_sig([3000, 3000, 3000], [3000, 3000], capacity=10_000)
    s = Signals(**{**s.__dict__, "usage": 0.01})
    assert WorkingSet().update(s).window == 3
    assert AIMD().update(s).window == 5  # AIMD grows on low U


def test_wset_cuts_on_measured_recompute_and_falls_back_without_capacity():
    p = WorkingSet()
    d = p.update(ws_sig([1000] * 8, [], window=8, recompute_rate=0.5))
    assert (d.window, d.branch) == (4, "cut:recompute")
    d = p.update(ws_sig([1000] * 8, [], capacity=None, window=8))
    assert d.branch.startswith("aimd-fallback")
    with pytest.raises(ValueError, match="target"):
        WorkingSet(target=0)
    assert make_policy("wset").wants_contexts and not make_policy("aimd").wants_contexts


def test_policy_parameters_parse_from_the_dataclass_fields():
    ws = make_policy("wset:target=0.8,headroom_steps=2")
    assert isinstance(ws, WorkingSet) and (ws.target, ws.headroom_steps) == (0.8, 2.0)
    assert make_policy("agent-cap:n=16").n == 16
    assert make_policy("aimd:alpha=4,initial=none").alpha == 4
    assert make_policy("aimd:initial=8").initial == 8
    # the AIMD flags set aimd's parameters, and wset's AIMD fallback
    assert make_policy("wset", u_high=0.6).fallback.u_high == 0.6
    assert make_policy("aimd", alpha=None).alpha == AIMD().alpha  # an unset flag is not passed


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("wset:0.5", {}, r"'0.5' is not key=value; valid keys: target, headroom_steps"),
        ("wset:tgt=1", {}, r"no parameter 'tgt'; valid: target, headroom_steps, max_recompute"),
        ("agent-cap:x", {}, r"n='x' is not a valid int"),
        ("aimd:alpha=2.5", {}, r"alpha='2.5' is not a valid int"),
        ("aimd:alpha=2,alpha=3", {}, r"'alpha' given twice"),
        ("aimd:alpha=3", {"alpha": 4}, r"given both as a flag and in --policy"),
        ("none", {"alpha": 3}, r"--alpha: AIMD options, which policy 'none' does not take"),
        ("agent-cap:8", {"initial": 3}, r"--initial-window: AIMD options"),
        ("none:x=1", {}, r"no parameter 'x'; valid: \(none\)"),
    ],
)
def test_bad_policy_parameters_are_errors_that_name_them(spec, options, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec, **options)


def test_every_registered_policy_is_listed_with_its_parameters():
    from runner.policies.registry import REGISTRY, describe

    listed = [describe(c) for c in REGISTRY.values()]
    assert "agent-cap:<n>" in listed and "none" in listed
    assert any(d.startswith("wset:target=0.9,headroom_steps=1.0") for d in listed)
    assert any(d.startswith("aimd:alpha=2,beta=0.5") for d in listed)


def test_wset_fit_is_the_plain_running_sum():
    # the bisection over C-level running sums gives the same count as adding agent by agent,
    # also where a context is below the shared prefix (the clamp) or the budget is tiny
    import random

    def plain(held, waiting, shared, growth, budget):
        fit = 0
        for ctx in (*held, *waiting):
            budget -= max(0, ctx - shared) + growth
            if budget < 0:
                break
            fit += 1
        return fit

    rng = random.Random(7)
    for _ in range(3000):
        held = tuple(rng.randint(0, 5000) for _ in range(rng.randint(0, 20)))
        waiting = tuple(rng.randint(0, 5000) for _ in range(rng.randint(0, 20)))
        shared, growth = rng.choice([0, 800]), rng.choice([0.0, 250.0])
        budget = rng.uniform(-10, 60_000)
        got = ContextList(held, waiting).fit(budget, growth, shared)
        assert got == plain(held, waiting, shared, growth, budget)
    with pytest.raises(ValueError, match="extra must be >= 0"):
        ContextList((1,)).fit(10.0, -1.0)


def test_wset_swarm_in_warmup_admits_every_agent_that_fits_at_once():
    # 2,048 short agents (300 tokens, 200 shared) on a 2M-token pool: all fit in the first
    # period; AIMD starts at 4 and adds 2 a period (the 0.60x-of-none warmup starvation)
    s = ws_sig(
        [], [300] * 2048, capacity=2_000_000, window=4, shared_tokens=200, growth_per_step=100.0
    )
    s = Signals(**{**s.__dict__, "usage": 0.02})  # nothing resident yet
    assert WorkingSet().update(s).window == 2048
    assert AIMD().initial_window(2048) == 4 and AIMD().update(s).window == 4 + 2


def test_wset_counts_a_host_tier_where_reloads_beat_recomputes():
    # 8 agents of 2,000 tokens on a 10K device pool: 4 fit on the device alone (0.9 x 10K);
    # a 20K host tier (write-through: it also holds the device's 10K) adds 10K
    held = [2000] * 8
    assert WorkingSet().update(ws_sig(held, [])).window == 4
    fast = ws_sig(held, [], host_capacity_tokens=20_000, host_reload_cost=0.05)
    assert WorkingSet().update(fast).window == 8  # 0.9 x 20K = 18K: eight agents
    # limited bandwidth: a reload dearer than recomputing is worth nothing
    slow = ws_sig(held, [], host_capacity_tokens=20_000, host_reload_cost=1.3)
    assert WorkingSet().update(slow).window == 4
    # a host tier no larger than the device holds nothing the device does not
    small = ws_sig(held, [], host_capacity_tokens=10_000, host_reload_cost=0.05)
    assert WorkingSet().update(small).window == 4
    # the tier can be ignored (the device-only policy, measured beside it)
    assert WorkingSet(use_host=False).update(fast).window == 4
