"""The SGLang-like engine simulator: radix cache, cost model, scheduler (virtual time)."""

from __future__ import annotations

import asyncio
import time

import pytest

from runner.engines.protocol import ContextLimitExceeded, EngineError, SamplingParams
from runner.sim.engine import (
    DEPLOYMENTS,
    CostModel,
    RadixCache,
    SimEngine,
    deployment,
    make_sim_engine,
)
from runner.sim.engine.radix import DEVICE, HOST
from runner.sim.vclock import run_virtual

EOS = 0


class ToyTokenizer:
    """Test double: token ids are ints, text is the ids joined by spaces, 0 is the EOS."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids if i != EOS)

    def token_text(self, token_id: int) -> str:
        return "<eos>" if token_id == EOS else str(token_id)

    def render(self, messages, tools=None, add_generation_prompt=True) -> str:
        return " ".join(m["content"] for m in messages)

    @property
    def supports_tools(self) -> bool:
        return False

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset({EOS})


class ScriptedModel:
    """Test double: the output of a prompt is `n` tokens unique to the prompt's last token,
    ending with EOS; `lengths` overrides n per last token."""

    def __init__(self, n: int = 8, lengths: dict[int, int] | None = None) -> None:
        self.n = n
        self.lengths = lengths or {}
        self.calls = 0

    def __call__(self, prompt: list[int]) -> list[int]:
        self.calls += 1
        last = prompt[-1]
        n = self.lengths.get(last, self.n)
        base = 10_000_000 + last * 10_000
        return [*range(base, base + n - 1), EOS]


def span(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def engine(model=None, **kw) -> SimEngine:
    kw.setdefault("stats_refresh_decode_steps", 0)  # live cache_stats in tests
    return make_sim_engine("tiny-cpu", ToyTokenizer(), model or ScriptedModel(), **kw)


SP = SamplingParams(max_new_tokens=64)


# ---- radix cache -------------------------------------------------------------------------


def test_radix_match_insert_split():
    t = RadixCache()
    t.insert([1, 2, 3, 4, 5])
    ins = t.insert([1, 2, 3, 6, 7])
    assert ins.device_prefix == 3  # [1, 2, 3] was there: the caller's copy is a duplicate
    assert t.device_tokens == 7 and t.evictable_tokens == 7
    m = t.match_prefix([1, 2, 3, 4, 9])
    assert (m.device_len, m.host_len) == (4, 0)
    assert m.node.key == (4,)  # the match split [4, 5]
    assert t.match_prefix([9]).length == 0
    assert t.match_prefix([1, 2, 3, 4, 5, 6], limit=2).length == 2
    assert t.prefix_len([1, 2, 3, 6, 7, 8]) == 5
    assert t.device_tokens == 7
    t.check()


def test_radix_insert_at_node_and_duplicates():
    t = RadixCache()
    a = t.insert([1, 2, 3]).node
    ins = t.insert([4, 5], at=a)  # the tokens after [1, 2, 3]
    assert ins.device_prefix == 3 and t.prefix_len([1, 2, 3, 4, 5]) == 5
    assert t.insert([1, 2, 3, 4, 5]).device_prefix == 5
    t.check()


def test_radix_lock_and_lru_eviction_order():
    t = RadixCache()
    a = t.insert(span(100, 10)).node  # oldest
    b = t.insert(span(200, 10)).node
    c = t.insert([*span(100, 5), *span(300, 10)]).node  # splits a after 5 tokens
    assert t.device_tokens == 30
    t.match_prefix(span(200, 10))  # b is now the most recent
    t.inc_lock(c)  # c and the shared [100..104] are protected
    assert t.protected_tokens == 15 and t.evictable_tokens == 15
    assert t.evict(1) == 5  # whole leaves go: a's tail [105..109], the LRU unlocked leaf
    assert not a.alive
    assert t.evict(1) == 10 and not b.alive
    assert t.evict(100) == 0  # the rest is locked
    t.dec_lock(c)
    assert t.evictable_tokens == 15
    assert t.evict(1) == 10  # c's leaf first, then its parent becomes a leaf
    assert t.evict(1) == 5 and t.device_tokens == 0
    t.check()


def test_radix_parent_evictable_only_after_last_child():
    t = RadixCache()
    t.insert([*span(1, 4), *span(10, 3)])
    t.insert([*span(1, 4), *span(20, 3)])
    t.match_prefix(span(1, 4))  # the shared parent is the most recently used node
    assert t.evict(1) == 3  # still a leaf goes first, not the (newer) parent
    assert t.evict(1) == 3
    assert t.evict(1) == 4
    t.check()


def test_radix_host_tier_write_through():
    t = RadixCache(host_capacity=12)  # SGLang's default: a node is backed up when inserted
    a = t.insert(span(100, 10)).node
    assert a.backed and t.host_tokens == 10
    b = t.insert(span(200, 10)).node
    assert not b.backed  # no room, and nothing host-only to evict for it
    assert t.evict(10) == 10 and a.tier == HOST  # LRU: a; its copy keeps it as host-only
    assert (t.device_tokens, t.host_tokens, t.host_only_tokens) == (10, 10, 10)
    m = t.match_prefix([*span(100, 10), 999])
    assert (m.device_len, m.host_len) == (0, 10) and m.node is a
    c = t.insert([*span(200, 10), *span(300, 4)]).node
    assert c.backed and not a.alive and t.host_tokens == 4  # room made by evicting a (LRU)
    assert t.evict(4) == 4 and c.tier == HOST  # c is the only device leaf
    m = t.match_prefix([*span(200, 10), *span(300, 4)])
    assert (m.device_len, m.host_len) == (10, 4)  # device part first, then host part
    assert t.load_back(m.node) == 4
    assert c.tier == DEVICE and c.backed  # loading back keeps the host copy
    assert (t.device_tokens, t.host_tokens, t.host_only_tokens) == (14, 4, 0)
    assert t.evict(100) == 14  # c goes to host, then b has no copy: dropped with its subtree
    assert t.device_tokens == t.host_tokens == 0 and t.nodes() == []
    t.check()


def test_radix_host_write_back_and_revive():
    t = RadixCache(host_capacity=5, write_policy="write_back")
    t.insert(span(100, 10))
    assert t.host_tokens == 0  # write-back: no copy until eviction
    t.evict(1)
    assert t.device_tokens == 0 and t.host_tokens == 0  # 10 > host capacity: dropped
    t.insert(span(200, 4))
    t.evict(1)
    assert t.host_tokens == t.host_only_tokens == 4
    ins = t.insert([*span(200, 4), 7])  # the caller recomputed it: the host node is revived
    assert ins.device_prefix == 0 and t.device_tokens == 5
    assert t.host_only_tokens == 0 and t.host_tokens == 4
    t.check()


def test_radix_priority_eviction():
    t = RadixCache(eviction_policy="priority")
    hi = t.insert(span(100, 5), priority=5).node
    lo = t.insert(span(200, 5), priority=1).node
    t.match_prefix(span(200, 5))  # lo is more recent, but has lower priority
    mid = t.insert(span(300, 5), priority=1).node  # same priority as lo, more recent
    t.insert(span(100, 5), priority=0)  # priority is never lowered
    assert hi.priority == 5
    assert t.evict(1) == 5 and not lo.alive  # lowest priority, least recent
    assert t.evict(1) == 5 and not mid.alive
    assert t.evict(1) == 5 and not hi.alive
    # a split keeps the priority on both parts; inserts raise it along the path
    a = t.insert(span(1, 6), priority=2).node
    t.insert([*span(1, 3), 99], priority=3)
    assert a.priority == 2 and a.parent.priority == 3
    t.check()


def test_radix_session_references_evict_unreferenced_first():
    t = RadixCache()
    old = t.insert(span(100, 5)).node
    new = t.insert(span(200, 5)).node
    t.ref(old)  # an open session's latest leaf: kept past LRU order
    assert t.evict(1) == 5 and not new.alive and old.alive
    other = t.insert(span(300, 5)).node
    t.unref(old)  # the session closed: plain LRU again, and `old` is the oldest
    assert t.evict(1) == 5 and not old.alive and other.alive
    t.unref(old)  # a dead node: nothing happens
    # a split keeps the reference on the lower part, the session's leaf
    leaf = t.insert(span(1, 6)).node
    t.ref(leaf)
    t.insert([*span(1, 3), 99])
    assert leaf.session_refs == 1 and leaf.parent.session_refs == 0
    t.check()


@pytest.mark.parametrize("sessions", [False, True])
def test_sessions_evict_closed_agents_first(sessions):
    """sessions=True (SGLang's session radix cache, as the adapter's --sglang-sessions uses
    it): a finished agent's KV goes before a live agent's, even when it is more recent."""

    async def main():
        eng = engine(sessions=sessions)
        await eng.generate(span(200_000, 6000), SP, agent="b")
        await eng.generate(span(100_000, 6000), SP, agent="a")  # more recent than b
        await eng.end_agent("a")
        await eng.end_agent("a")  # idempotent
        await eng.generate(span(300_000, 9000), SP, agent="c")  # must evict a or b
        b2 = await eng.generate([*span(200_000, 6000), 1], SP, agent="b")
        await eng.end_agent("b")
        await eng.end_agent("c")
        eng.check()
        st = eng.stats()
        await eng.aclose()
        return b2, st

    b2, st = run_virtual(main())
    if sessions:
        assert b2.cached_tokens == 6000  # b's prefix survived
        assert st["sessions_open"] == 0
    else:  # LRU: b is the oldest and goes
        assert b2.cached_tokens == 0 and st["sessions_open"] is None


def test_aclose_closes_open_sessions():
    async def main():
        eng = engine(sessions=True)
        await eng.generate(span(100_000, 100), SP, agent="a")
        opened = eng.stats()["sessions_open"]
        await eng.aclose()  # an interrupted batch never called end_agent
        return opened, eng.stats()["sessions_open"], eng.tree.nodes()

    opened, closed, nodes = run_virtual(main())
    assert (opened, closed) == (1, 0)
    assert all(n.session_refs == 0 for n in nodes)


# ---- cost model --------------------------------------------------------------------------


# Qwen3-32B (config.json) by hand
P_QWEN = 64 * (5120 * 64 * 128 + 2 * 5120 * 8 * 128 + 64 * 128 * 5120 + 3 * 5120 * 25600)
BYTES_QWEN = 2 * (P_QWEN + 64 * (2 * 5120 + 2 * 128) + 5120 + 2 * 151936 * 5120)


def test_cost_model_by_hand_qwen_tp2():
    cm = CostModel(DEPLOYMENTS["qwen3-32b-tp2"])
    assert P_QWEN == 31_205_621_760
    rate = 989e12 * 0.6 * 2  # FLOP/s of two GPUs at 60%
    bw = 3.35e12 * 0.8
    pair = 2 * 64 * 64 * (128 + 128)
    lm_head = 2 * 5120 * 151936

    # one prefill of 1000 new tokens at positions 0..999, one token sampled
    compute = (2 * P_QWEN * 1000 + lm_head) / rate + pair * (1000 * 1001 // 2) / rate
    memory = (BYTES_QWEN / 2 + 2 * 64 * 4 * 128 * 2 * 1000) / bw
    allreduce = 2 * 64 * (1000 * 5120 * 2 / (450e9 * 0.8) + 10e-6)
    expected = max(compute, memory) + allreduce + 0.003 + 64 * 30e-6  # fixed + per layer
    c = cm.prefill([(0, 1000)], recompute_tokens=250)
    assert c.seconds == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.06331, abs=1e-4)
    assert c.prefill_recompute == pytest.approx(0.25 * expected)
    assert c.prefill_new + c.prefill_recompute == pytest.approx(c.seconds)

    # one decode iteration: 4 requests attending 4000 cached tokens in all
    compute = 4 * (2 * P_QWEN + lm_head) / rate + pair * 4000 / rate
    memory = (BYTES_QWEN / 2 + 2 * 64 * 4 * 128 * 2 * 4000) / bw
    assert memory > compute  # decode is bandwidth-bound
    allreduce = 2 * 64 * (4 * 5120 * 2 / (450e9 * 0.8) + 10e-6)
    assert cm.decode(4, 4000) == pytest.approx(memory + allreduce + 0.001 + 64 * 30e-6, rel=1e-12)

    # HiCache reload: each GPU copies its half of the KV over PCIe, layer by layer beside
    # the forward: the longer of the two streams plus one layer (of 64) of the other
    assert cm.host_load(1000) == pytest.approx(1000 * 131072 / 50e9)
    body = cm.prefill([(500, 600)]).seconds
    c = cm.prefill([(500, 600)], host_tokens=1000)
    load = cm.host_load(1000)
    assert load < body  # a small reload hides under the forward but for one layer of it
    assert c.seconds == pytest.approx(body + load / 64)
    assert c.parts["host_transfer"] == pytest.approx(load)
    assert c.host_load == pytest.approx(load / 64)  # the part not hidden
    assert c.seconds == pytest.approx(c.prefill_new + c.host_load)
    big = cm.prefill([(500, 600)], host_tokens=1_000_000)  # a reload longer than the forward
    assert big.seconds == pytest.approx(cm.host_load(1_000_000) + body / 64)


def test_cost_model_by_hand_deepseek_tp16():
    """MoE weights read by a batch-1 decode, MLA KV reads, and the two-node all-reduce."""
    d = DEPLOYMENTS["deepseek-v3-tp16"]
    cm = CostModel(d)
    attn = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    expert = 3 * 7168 * 2048
    norms = 61 * (2 * 7168 + 1536 + 512) + 7168
    emb = 2 * 129280 * 7168
    total = 61 * attn + 3 * 3 * 7168 * 18432 + 58 * (7168 * 256 + 257 * expert) + norms + emb
    assert d.model.params_total == total
    weights = total + emb + norms  # fp8, embeddings and norms bf16 (one more byte each)
    read = weights - (256 - 8) * 58 * expert  # one token touches 8 routed experts
    memory = (read / 16 + 70272 * 1000) / (3.35e12 * 0.8)
    size = 7168 * 2  # one token's activations
    one = 2 * 7 / 8 * size / (450e9 * 0.8) + 25e-6 + 2 * (1 / 2) * (size / 8) / (50e9 * 0.8)
    allreduce = 2 * 61 * one
    assert cm.allreduce(1) == pytest.approx(allreduce, rel=1e-12)
    parts = cm.decode_parts(1, 1000)
    assert parts["memory"] == pytest.approx(memory, rel=1e-12) and parts["compute"] < memory
    fixed = 0.001 + 61 * 60e-6
    assert cm.decode(1, 1000) == pytest.approx(memory + allreduce + fixed, rel=1e-12)


def test_pool_capacity_follows_sglang_profile():
    total = 81559 * 2**20 - 1.5 * 2**30  # free memory SGLang measures before loading
    for tp in (2, 4, 8):
        rest = total * 0.88 - BYTES_QWEN / tp
        cell = 2 * 64 * (8 // tp) * 128 * 2
        assert DEPLOYMENTS[f"qwen3-32b-tp{tp}"].pool_tokens == int(rest // cell)
    assert DEPLOYMENTS["qwen3-32b-tp2"].pool_tokens == 313_406
    ds = DEPLOYMENTS["deepseek-v3-tp16"]
    assert ds.kv_bytes_per_token_per_gpu == (512 + 64) * 61 * 2  # MLA latent, replicated
    assert ds.model.params_total == pytest.approx(671e9, rel=0.002)
    assert ds.model.params_active == pytest.approx(37e9, rel=0.05)
    assert ds.pool_tokens == int((total * 0.88 - ds.model.weight_bytes / 16) // 70272)
    assert DEPLOYMENTS["tiny-cpu"].pool_tokens == 20_000
    cm = CostModel(ds)  # MoE: a small decode batch reads only the experts it routes to
    assert cm.decode(1, 1000) < cm.decode(64, 1000)


# ---- scheduler ---------------------------------------------------------------------------


async def _one(eng: SimEngine, ids: list[int], sp: SamplingParams = SP):
    return await eng.generate(ids, sp)


def test_generation_fields_and_finish_reasons():
    model = ScriptedModel(n=5, lengths={7: 100})

    async def main():
        eng = engine(model)
        g = await eng.generate(span(1, 20), SP)
        cut = await eng.generate([*span(1, 20), 7], SamplingParams(max_new_tokens=10))
        eng.check()
        await eng.aclose()
        return g, cut

    g, cut = run_virtual(main())
    base = 10_000_000 + 20 * 10_000
    assert g.output_ids == [*span(base, 4), EOS]
    assert g.text == " ".join(map(str, span(base, 4)))
    assert (g.finish_reason, g.stopped_on_eos, g.completion_tokens) == ("stop", True, 5)
    assert g.prompt_tokens == 20 and g.cached_tokens == 0 and g.seconds > 0
    assert (cut.finish_reason, cut.stopped_on_eos, cut.completion_tokens) == ("length", False, 10)
    assert cut.cached_tokens == 20  # the first request's prompt was cached


def test_context_limit_and_bad_requests():
    async def main():
        eng = engine()
        with pytest.raises(ContextLimitExceeded):
            await eng.generate(span(1, 16000), SamplingParams(max_new_tokens=500))
        with pytest.raises(EngineError):
            await eng.generate([], SP)
        await eng.aclose()
        with pytest.raises(EngineError):
            await eng.generate([1], SP)

    run_virtual(main())
    assert engine().context_limit == 16384 and engine().name == "sim"


def test_cached_tokens_for_a_shared_prefix():
    async def main():
        eng = engine()
        system = span(1000, 300)
        a = await eng.generate([*system, *span(5000, 50)], SP)
        b = await eng.generate([*system, *span(6000, 50)], SP)
        same = await eng.generate([*system, *span(6000, 50)], SP)
        cont = span(6000, 50) + b.output_ids + [77]
        c = await eng.generate([*system, *cont], SP)
        eng.check()
        st = eng.stats()
        await eng.aclose()
        return a, b, same, c, st

    a, b, same, c, st = run_virtual(main())
    assert a.cached_tokens == 0
    assert b.cached_tokens == 300
    assert same.cached_tokens == 349  # SGLang recomputes at least the last prompt token
    # the previous reply is cached except its last token, whose KV was never computed
    assert c.cached_tokens == 350 + len(b.output_ids) - 1
    assert st["cached_tokens"] == 300 + 349 + c.cached_tokens
    assert st["tokens_prefill_recompute"] == 0


def test_chunked_prefill_spreads_a_long_prompt():
    async def main():
        eng = engine(chunked_prefill_size=1000)
        g = await eng.generate(span(1, 3500), SP)
        st = eng.stats()
        await eng.aclose()
        return g, st

    g, st = run_virtual(main())
    assert st["prefill_iterations"] == 4  # 1000 + 1000 + 1000 + 500
    assert st["tokens_prefill_new"] == 3500
    assert st["decode_iterations"] == len(g.output_ids) - 1  # the prefill samples one token


def test_a_long_prompt_behind_others_is_chunked_into_their_iteration():
    # SGLang 0.5.16 on: with chunked prefill the per-iteration input cap
    # (max_prefill_tokens) does not turn a long request away from a batch that already
    # holds others (schedule_policy.py checks it only when chunking is off); it takes the
    # chunk left: 200 + 800, then 1000 and 1000 (0.5.9 stopped the batch after the 200)
    async def main():
        eng = engine(chunked_prefill_size=1000, max_prefill_tokens=1500)
        await asyncio.gather(eng.generate(span(1, 200), SP), eng.generate(span(5000, 2800), SP))
        st = eng.stats()
        await eng.aclose()
        return st

    st = run_virtual(main())
    assert st["tokens_prefill_new"] == 3000
    assert st["prefill_iterations"] == 3


def test_usage_and_physical_occupancy():
    async def main():
        eng = engine(ScriptedModel(n=200))
        assert eng.cache_stats().usage == 0
        task = asyncio.create_task(eng.generate(span(1, 2000), SamplingParams(max_new_tokens=300)))
        await asyncio.sleep(0.05)  # prefill done, decoding
        mid = eng.cache_stats()
        g = await task
        end = eng.cache_stats()
        await eng.aclose()
        return mid, end, g

    mid, end, g = run_virtual(main())
    kv = 2000 + len(g.output_ids) - 1
    assert mid.capacity_tokens == 20_000
    assert 2000 < mid.used_tokens < kv  # the locked prompt and the decoded tokens so far
    assert mid.usage == pytest.approx(mid.used_tokens / 20_000)
    assert mid.extra["physical_occupancy"] == pytest.approx(mid.usage)  # nothing evictable
    assert mid.extra["running"] == 1
    # finished: its KV stays cached (evictable), SGLang's token_usage drops to zero
    assert end.usage == 0 and end.used_tokens == 0
    assert end.extra["evictable_tokens"] == kv
    assert end.extra["physical_occupancy"] == pytest.approx(kv / 20_000)


def test_pool_token_seconds_by_holder():
    """The pool's token-seconds split by what holds them: a request's locked KV while it
    prefills and decodes, its cached KV once it finished (the engine idle), the rest free;
    the four add up to the capacity times the time elapsed."""

    async def main():
        eng = engine(ScriptedModel(n=200))
        await eng.generate(span(1, 2000), SamplingParams(max_new_tokens=300))
        one = eng.stats()
        await asyncio.sleep(1.0)  # the engine idles with the request's KV cached
        await eng.generate(span(50_000, 1000), SP)
        two = eng.stats()
        await eng.aclose()
        return one, two

    one, two = run_virtual(main())
    keys = ("decoding", "prefilling", "cached", "free")
    for st in (one, two):
        total = sum(st[f"kv_token_seconds_{k}"] for k in keys)
        elapsed = st["seconds_busy"] + st["seconds_idle"]
        assert total == pytest.approx(st["capacity_tokens"] * elapsed, rel=1e-9)
    # alone: its 2,000 prompt tokens are allocated for its prefill, then it decodes 199
    # tokens holding 2,000 to 2,198 of them; nothing else is cached
    assert one["kv_token_seconds_prefilling"] == pytest.approx(2000 * one["seconds_prefill_new"])
    held = one["kv_token_seconds_decoding"] / one["seconds_decode"]
    assert 2000 < held < 2199
    assert one["kv_token_seconds_cached"] == 0
    # then its 2,199 tokens stay cached while the engine idles for a second and while the
    # second request runs
    kv = 2000 + 200 - 1
    busy = two["seconds_busy"] - one["seconds_busy"]
    cached = two["kv_token_seconds_cached"]
    assert two["seconds_idle"] - one["seconds_idle"] == pytest.approx(1.0)
    assert cached == pytest.approx(kv * (1.0 + busy))


def test_retraction_when_decode_runs_out_of_memory():
    """Ten requests of 1000 + 1990 tokens cannot all decode in a 20k pool. Six fit at first;
    when the short one finishes, new_token_ratio has decayed, admission over-commits, and
    decode has to retract (SGLang's behaviour)."""
    model = ScriptedModel(n=1990, lengths={10_999: 700})

    async def main():
        eng = engine(model)
        sp = SamplingParams(max_new_tokens=2000)
        gens = await asyncio.gather(
            *(eng.generate(span(i * 10_000, 1000), sp) for i in range(1, 11))
        )
        eng.check()
        st = eng.stats()
        await eng.aclose()
        return gens, st

    gens, st = run_virtual(main())
    assert st["retractions"] > 0
    assert st["tokens_prefill_recompute"] > 0  # retracted requests recompute their output
    for i, g in enumerate(gens, start=1):
        base = 10_000_000 + (i * 10_000 + 999) * 10_000
        n = 700 if i == 1 else 1990
        assert g.output_ids == [*span(base, n - 1), EOS]
        assert g.finish_reason == "stop"


def test_recompute_accounting_after_eviction():
    async def main():
        eng = engine()
        a = await eng.generate(span(100_000, 6000), SP)
        await eng.generate(span(200_000, 12000), SP)
        await eng.generate(span(300_000, 12000), SP)  # evicts a's prefix (LRU)
        before = eng.stats()
        again = span(100_000, 6000) + a.output_ids + span(400_000, 100)
        a2 = await eng.generate(again, SP)
        after = eng.stats()
        eng.check()
        await eng.aclose()
        return a, a2, before, after

    a, a2, before, after = run_virtual(main())
    assert before["tokens_prefill_recompute"] == 0 and before["evicted_tokens"] > 0
    assert a2.cached_tokens == 0
    kv_of_a = 6000 + len(a.output_ids) - 1
    assert after["tokens_prefill_recompute"] == kv_of_a
    new = 6000 + len(a.output_ids) + 100 - kv_of_a
    assert after["tokens_prefill_new"] - before["tokens_prefill_new"] == new
    assert after["seconds_prefill_recompute"] > 0


def test_hicache_reloads_from_host():
    async def main():
        eng = engine(hicache_tokens=40_000)
        a = await eng.generate(span(100_000, 6000), SP)
        await eng.generate(span(200_000, 12000), SP)
        await eng.generate(span(300_000, 12000), SP)  # a's prefix goes to host memory
        a2 = await eng.generate(span(100_000, 6000) + a.output_ids + [5], SP)
        st = eng.stats()
        eng.check()
        await eng.aclose()
        return a, a2, st

    a, a2, st = run_virtual(main())
    kv_of_a = 6000 + len(a.output_ids) - 1
    assert a2.cached_host_tokens == kv_of_a and a2.cached_tokens == kv_of_a
    assert st["tokens_host_load"] == kv_of_a and st["seconds_host_load"] > 0
    assert st["tokens_prefill_recompute"] == 0


@pytest.mark.parametrize("policy", ["lru", "priority"])
def test_priority_option_protects_earlier_agents(policy):
    """priority="fifo" (as in the SGLang adapter): agents seen earlier rank higher; with
    eviction_policy="priority" their prefixes outlive more recent ones of later agents."""

    async def main():
        eng = engine(eviction_policy=policy, priority="fifo")
        await eng.generate(span(100_000, 6000), SP, agent="a")
        await eng.generate(span(200_000, 6000), SP, agent="b")
        await eng.generate(span(300_000, 12000), SP, agent="c")  # must evict a or b
        a2 = await eng.generate([*span(100_000, 6000), 1], SP, agent="a")
        b2 = await eng.generate([*span(200_000, 6000), 1], SP, agent="b")
        await eng.end_agent("a")
        await eng.end_agent("a")  # idempotent
        eng.check()
        await eng.aclose()
        return a2, b2, eng.agent_stats()

    a2, b2, agents = run_virtual(main())
    if policy == "priority":
        assert (a2.cached_tokens, b2.cached_tokens) == (6000, 0)
    else:  # LRU evicts the oldest, a; recomputing a then evicts b: thrashing
        assert (a2.cached_tokens, b2.cached_tokens) == (0, 0)
    assert set(agents) == {"a", "b", "c"}
    assert agents["a"]["requests"] == 2 and agents["a"]["prompt_tokens"] == 12001
    assert agents["a"]["cached_tokens"] == a2.cached_tokens
    assert agents["c"]["completion_tokens"] == 8


def test_max_new_tokens_clipped_to_a_small_pool():
    async def main():
        eng = engine(ScriptedModel(n=5000), max_total_tokens=3000)
        g = await eng.generate(span(1, 2500), SamplingParams(max_new_tokens=1000))
        with pytest.raises(ContextLimitExceeded):
            await eng.generate(span(1, 2996), SP)
        eng.check()
        await eng.aclose()
        return g

    g = run_virtual(main())
    assert g.completion_tokens == 3000 - 1 - 2500 - 1  # SGLang: max_req_len - prompt - 1
    assert g.finish_reason == "length" and not g.stopped_on_eos


def test_cancelled_request_is_dropped_cleanly():
    async def main():
        eng = engine(ScriptedModel(n=50))
        slow = asyncio.create_task(eng.generate(span(1, 3000), SP))
        queued = asyncio.create_task(eng.generate(span(10_000, 3000), SP))
        await asyncio.sleep(0.001)
        queued.cancel()
        await asyncio.sleep(0.05)
        slow.cancel()  # cancelled while decoding
        other = await eng.generate(span(20_000, 100), SP)
        eng.check()
        st = eng.stats()
        await eng.aclose()
        return slow, queued, other, st, eng

    slow, queued, other, st, eng = run_virtual(main())
    assert slow.cancelled() and queued.cancelled()
    assert other.completion_tokens == 50
    assert st["requests_cancelled"] == 2 and st["requests_finished"] == 1
    assert eng.cache_stats().usage == 0


def _workload(eng: SimEngine, n_agents: int, steps: int, obs: int = 400, sp: SamplingParams = SP):
    """Agents with a shared system prompt, growing contexts and tool waits."""

    async def agent(i: int):
        ids = [*span(1, 200), *span(10_000_000 * (i + 1), 300)]
        gens = []
        for s in range(steps):
            g = await eng.generate(ids, sp)
            gens.append((g.cached_tokens, g.completion_tokens, round(g.seconds, 9)))
            await asyncio.sleep(0.3 + 0.1 * ((i * 7 + s) % 5))  # the tool
            ids = ids + g.output_ids + span(10_000_000 * (i + 1) + 100_000 * (s + 1), obs)
        return gens

    async def main():
        out = await asyncio.gather(*(agent(i) for i in range(n_agents)))
        eng.check()
        await eng.aclose()
        return out, eng.stats(), asyncio.get_running_loop().time()

    return run_virtual(main())


def test_deterministic_and_fast_forward_is_exact():
    model = ScriptedModel(n=40)
    a = _workload(engine(model), 12, 5)
    b = _workload(engine(model), 12, 5)
    assert a == b
    # one decode iteration per step gives the same schedule as fast-forwarded blocks
    c = _workload(engine(model, fast_forward_cap=1), 12, 5)
    gens_a, st_a, t_a = a
    gens_c, st_c, t_c = c
    assert [[x[:2] for x in g] for g in gens_a] == [[x[:2] for x in g] for g in gens_c]
    flat_a = [x[2] for g in gens_a for x in g]
    flat_c = [x[2] for g in gens_c for x in g]
    assert flat_a == pytest.approx(flat_c, rel=1e-9)
    assert t_a == pytest.approx(t_c, rel=1e-9)
    assert st_a["decode_blocks"] < st_c["decode_blocks"] == st_c["decode_iterations"]
    for k in ("decode_iterations", "prefill_iterations", "tokens_prefill_recompute"):
        assert st_a[k] == st_c[k]
    assert st_a["tokens_prefill_recompute"] > 0  # the pool is small: this run thrashes


def test_speed_256_concurrent_agents():
    """Printed, not asserted: wall time of 256 concurrent agents (6 steps, 300 generated
    tokens per step, contexts growing to ~14K) on the Qwen3-32B TP8 preset."""
    model = ScriptedModel(n=300)
    eng = make_sim_engine("qwen3-32b-tp8", ToyTokenizer(), model)
    t0 = time.perf_counter()
    gens, st, vt = _workload(eng, 256, 6, obs=2000, sp=SamplingParams(max_new_tokens=512))
    wall = time.perf_counter() - t0
    assert len(gens) == 256 and all(c == 300 for g in gens for _, c, _ in g)
    print(
        f"\n[sim speed] 256 agents x 6 steps: {wall:.2f} s wall, {vt:.1f} s virtual, "
        f"{st['iterations']} iterations ({st['prefill_iterations']} prefill, "
        f"{st['decode_iterations']} decode in {st['decode_blocks']} blocks), "
        f"{st['retractions']} retractions"
    )


def test_cache_stats_report_the_host_tier_and_its_reload_cost():
    from runner.engines.chatml_tokenizer import ChatMLTokenizer
    from runner.sim.engine import CostModel, make_sim_engine
    from runner.sim.engine import deployment as dep

    tok = ChatMLTokenizer()
    plain = make_sim_engine("tiny-cpu", tok, lambda ids: [tok.eos_ids[0]])
    assert plain.cache_stats().host_capacity_tokens is None
    assert plain.cache_stats().host_reload_cost is None
    eng = make_sim_engine(
        "tiny-cpu", tok, lambda ids: [tok.eos_ids[0]], hicache_tokens=5000, pcie_bytes_per_s=1e8
    )
    cost = CostModel(dep("tiny-cpu"), 1e8)
    stats = eng.cache_stats()
    assert stats.host_capacity_tokens == 5000
    assert stats.host_reload_cost == pytest.approx(
        cost.host_load(1) / cost.prefill_linear_per_token
    )


async def test_on_a_plain_asyncio_loop():
    """Without runner.sim.vclock's VirtualClock (plain asyncio, real time: the test's own loop)
    the engine still serves every request exactly (only its decode blocks are not cut at the
    next timer). The same run on virtual time, for comparison, goes to a thread: a loop
    cannot be started inside another one."""
    model = ScriptedModel(n=40)

    async def main():
        eng = engine(model)

        async def agent(i: int):
            ids = [*span(1, 200), *span(10_000_000 * (i + 1), 300)]
            out = []
            for s in range(3):
                g = await eng.generate(ids, SP)
                out.append((g.prompt_tokens, g.cached_tokens, g.output_ids))
                await asyncio.sleep(0.01 * (i + 1))  # the tool
                ids = ids + g.output_ids + span(10_000_000 * (i + 1) + 100_000 * (s + 1), 50)
            return out

        gens = await asyncio.gather(*(agent(i) for i in range(4)))
        eng.check()
        st = eng.stats()
        await eng.aclose()
        return gens, st

    plain, st = await main()
    virtual, st_v = await asyncio.to_thread(run_virtual, main())
    assert plain == virtual
    assert st["requests_finished"] == 12 and st["tokens_decode"] == st_v["tokens_decode"]


def test_pool_scale_scales_the_pool_after_the_cap():
    plain = deployment("qwen3-32b-tp8").pool_tokens
    assert deployment("qwen3-32b-tp8", pool_scale=2.0).pool_tokens == 2 * plain
    assert deployment("qwen3-32b-tp8", pool_scale=0.5).pool_tokens == plain // 2
    capped = deployment("deepseek-v3-tp16-paper", pool_scale=0.5)
    assert capped.pool_tokens == 140_000  # half of the 280K cap
    with pytest.raises(ValueError, match="pool_scale must be > 0"):
        _ = deployment("qwen3-32b-tp8", pool_scale=0.0).pool_tokens
