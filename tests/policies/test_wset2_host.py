"""wset2 with a host KV tier (HiCache): its decisions on constructed situations (signals in,
decision out), and the signals it reads from the simulated engine and the controller."""

import random

import pytest

from runner.engines.chatml_tokenizer import ChatMLTokenizer
from runner.engines.protocol import CacheStats
from runner.gate.control import Controller
from runner.gate.gate import Gate
from runner.policies.protocol import Signals
from runner.policies.registry import make_policy
from runner.policies.wset2 import WorkingSet2
from runner.sim.engine import make_sim_engine
from tests.policies.test_wset2 import ws_sig


def host_sig(held, paused=(), pending=(), **kw):
    """Slot holders `held`, then the paused waiters, then the pending ones (the gate's
    order), on a 10K device pool."""
    return ws_sig(held, (*paused, *pending), paused=len(paused), pending=len(pending), **kw)


# a host tier 10x the device, reloads 20x cheaper than recomputes, a 1 s control period
TIER = dict(host_capacity_tokens=100_000, host_reload_cost=0.05, period_seconds=1.0)


def test_with_a_host_tier_the_reserve_is_waived_while_everyone_fits_both_tiers():
    # ten agents of 1,900 tokens, a 20K host tier over the 10K device. All of them fit both
    # tiers: nobody needs to wait (overflowing the device only costs reloads), so no reserve
    held = [1900] * 10
    tier = dict(host_capacity_tokens=20_000, host_reload_cost=0.05)
    assert WorkingSet2().update(host_sig(held, **tier)).window == 10
    # with the shared prefix counted once: 10 x 2,900 over a 1,000-token prefix is 20K
    shared = host_sig([2900] * 10, **tier, shared_tokens=1000)
    assert WorkingSet2().update(shared).window == 10
    # more contexts than both tiers hold (one more waiting): agents rotate, the reserve is
    # kept, 0.9 x 20K holds nine
    assert WorkingSet2().update(host_sig(held, [1900], **tier)).window == 9
    # on the device alone the reserve is always kept: 9K
    assert WorkingSet2().update(host_sig(held)).window == 4
    assert WorkingSet2(use_host=False).update(host_sig(held, **tier)).window == 4


def test_resumes_are_capped_by_the_host_links_time_in_a_period():
    # two holders and five paused agents of 2,000 tokens: all fit both tiers, but at 1e-4 s
    # a token the link reloads 5,000 tokens in half a period: two resume this period
    held, paused = [2000] * 2, [2000] * 5
    slow = host_sig(held, paused, **TIER, host_reload_token_seconds=1e-4)
    d = WorkingSet2().update(slow)
    assert (d.window, d.branch) == (4, "fit:reload-cap")
    # the whole period's link time: five
    assert WorkingSet2(reload_share=1.0).update(slow).window == 7
    # a link 10x faster reloads them all at once
    fast = host_sig(held, paused, **TIER, host_reload_token_seconds=1e-5)
    assert WorkingSet2().update(fast).window == 7
    # a link too slow for even one still resumes one a period
    crawl = host_sig(held, paused, **TIER, host_reload_token_seconds=1.0)
    assert WorkingSet2().update(crawl).window == 3


def test_the_cap_counts_only_what_comes_back_from_the_host():
    held = [2000] * 2
    # agents never admitted have nothing to reload: the cap does not slow a warmup
    pending = host_sig(held, pending=[2000] * 5, **TIER, host_reload_token_seconds=1e-4)
    assert WorkingSet2().update(pending).window == 7
    # the shared prefix stays on the device: 9,000-token contexts over an 8,000-token shared
    # prompt reload 1,000 each, five in the 5,000 tokens of half a period
    shared = host_sig(
        [9000] * 2, [9000] * 6, **TIER, host_reload_token_seconds=1e-4, shared_tokens=8000
    )
    assert WorkingSet2().update(shared).window == 7
    # the cap never pauses a holder: with nobody paused there is nothing to cap
    nobody = host_sig([2000] * 7, **TIER, host_reload_token_seconds=1.0)
    assert WorkingSet2().update(nobody).window == 7


def test_the_cap_never_raises_the_fit_or_undoes_a_recompute_cut():
    held, paused = [2000] * 4, [2000] * 4
    kw = dict(**TIER, host_reload_token_seconds=1e-5)  # 50K tokens a half period: no cap
    cut = WorkingSet2().update(host_sig(held, paused, recompute_rate=0.5, window=8, **kw))
    assert (cut.window, cut.branch) == (4, "cut:recompute")
    slow = {**kw, "host_reload_token_seconds": 1e-4}  # cap at 4 + 2 = 6, above the cut
    cut = WorkingSet2().update(host_sig(held, paused, recompute_rate=0.5, window=8, **slow))
    assert (cut.window, cut.branch) == (4, "cut:recompute")
    # a small host tier binds first: eight agents' 16K exceed its 11K, so the reserve is
    # kept and 9.9K hold four (below the cap of six)
    small = {**slow, "host_capacity_tokens": 11_000}
    assert WorkingSet2().update(host_sig(held, paused, **small)).window == 4


def test_a_host_tier_no_larger_than_the_device_or_dearer_than_recompute_changes_nothing():
    held, paused = [2000] * 3, [2000] * 5
    plain = WorkingSet2().update(host_sig(held, paused))
    assert plain.window == 4
    link = dict(host_reload_token_seconds=1e-4, period_seconds=1.0)
    small = host_sig(held, paused, host_capacity_tokens=10_000, host_reload_cost=0.05, **link)
    dear = host_sig(held, paused, host_capacity_tokens=100_000, host_reload_cost=1.3, **link)
    for s in (small, dear):
        assert WorkingSet2().update(s) == plain  # neither the tier nor the cap


def test_without_a_host_tier_the_new_signals_change_no_decision():
    # random situations (holders, waiters, tools, recompute): the link and period signals
    # alone, with no host tier, give today's decision
    rng = random.Random(7)
    for _ in range(300):
        held = [rng.randint(0, 4000) for _ in range(rng.randint(0, 12))]
        waiting = [rng.randint(0, 4000) for _ in range(rng.randint(0, 12))]
        kw = dict(
            held_tool_seconds=tuple(rng.choice((0.0, 0.5, 30.0)) for _ in held),
            tool_durations=(0.5,) * 8 + (60.0,) * 2,
            recompute_token_seconds=rng.choice((None, 1e-3)),
            recompute_rate=rng.choice((None, 0.0, 0.5)),
            shared_tokens=rng.choice((None, 500)),
            growth_per_step=rng.choice((None, 100.0)),
        )
        base = host_sig(held, pending=waiting, **kw)
        link = dict(host_reload_token_seconds=1.0, period_seconds=1.0)
        extra = host_sig(held, pending=waiting, **kw, **link)
        assert WorkingSet2().update(extra) == WorkingSet2().update(base)
    with pytest.raises(ValueError, match="reload_share"):
        make_policy("wset2:reload_share=0")


def test_the_simulated_engine_reports_its_reload_time_per_token():
    tok = ChatMLTokenizer()
    eng = make_sim_engine("qwen3-32b-tp8", tok, lambda ids: [], hicache_tokens=4_000_000)
    stats = eng.cache_stats()
    # 32,768 bytes of KV per token per GPU at 50 GB/s: 0.66 us, ~34x cheaper than recomputing
    assert stats.host_reload_token_seconds == pytest.approx(32768 / 50e9)
    assert stats.recompute_token_seconds / stats.host_reload_token_seconds > 30
    plain = make_sim_engine("qwen3-32b-tp8", tok, lambda ids: []).cache_stats()
    assert plain.host_reload_token_seconds is None


def test_the_controller_hands_the_policy_its_period_and_the_link_time():
    seen: list[Signals] = []

    class Spy(WorkingSet2):
        def update(self, s: Signals):
            seen.append(s)
            return super().update(s)

    stats = CacheStats(0.1, 10_000, host_capacity_tokens=20_000, host_reload_cost=0.05,
                       host_reload_token_seconds=2e-6)  # fmt: skip
    gate = Gate(4, clock=lambda: 0.0)
    ctl = Controller(gate, Spy(), lambda: stats, period=0.5, clock=lambda: 0.0)
    ctl.step()
    assert seen[0].period_seconds == 0.5 and seen[0].host_reload_token_seconds == 2e-6
