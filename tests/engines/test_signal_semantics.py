"""U and H mean the same on every engine the gate reads: SGLang's meanings (docs/sglang.md).

The SGLang adapter passes SGLang's own `token_usage` and `cached_tokens` through
(tests/contract/test_sglang_contract.py); what they mean is SGLang's scheduler's definition:

- U = tokens held by running requests / the pool (`num_used / max_total_num_tokens`, where
  the radix cache's evictable tokens count as free): a finished request's cached KV stays,
  and U drops to 0.
- `cached_tokens` = the prompt's prefix matched in the cache, at most the prompt's length
  minus one (the last token is always computed); a finished request leaves its prompt and
  all its output but the last token cached (`cache_finished_req`). H is the control loop's
  sum of cached over prompt tokens, the same code for every engine.

One scenario, run on the simulator (the project's model of SGLang, on virtual time) and on
the real llama.cpp engine, must show the same figures for both.
"""

from __future__ import annotations

import asyncio

import pytest

from runner.engines.protocol import SamplingParams
from runner.sim.engine import make_sim_engine
from runner.sim.vclock import run_virtual
from tests.sim.test_sim_engine import ScriptedModel, ToyTokenizer

NEW = 24


async def scenario(eng, prompt: list[int], ext: list[int]) -> dict:
    """Idle; one request, watched while it decodes; finished; the agent's next turn;
    another agent with the same prompt."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    out = {"idle": eng.cache_stats()}
    task = asyncio.create_task(eng.generate(prompt, sp, agent="a"))
    for _ in range(100_000):
        await asyncio.sleep(0.001)
        st = eng.cache_stats()
        if st.extra.get("running") == 1 and st.used_tokens > len(prompt):
            out["mid"] = st
            break
    g = await task
    out["gen"], out["after"] = g, eng.cache_stats()
    out["turn"] = await eng.generate(prompt + g.output_ids + ext, sp, agent="a")
    out["other"] = await eng.generate(prompt, sp, agent="b")
    return out


def check(out: dict, prompt: list[int], ext: list[int]) -> None:
    idle, mid, after, g = out["idle"], out["mid"], out["after"], out["gen"]
    assert idle.usage == 0
    # running: the prompt and the tokens decoded so far are held, nothing else
    assert len(prompt) < mid.used_tokens <= len(prompt) + NEW
    assert mid.usage == pytest.approx(mid.used_tokens / mid.capacity_tokens)
    assert mid.extra["physical_occupancy"] == pytest.approx(mid.usage)  # nothing evictable
    # finished: U is 0, its KV stays (evictable)
    assert after.usage == 0 and after.used_tokens == 0
    assert after.extra["physical_occupancy"] > 0
    # the next turn finds the prompt and every output token but the last
    assert out["turn"].prompt_tokens == len(prompt) + len(g.output_ids) + len(ext)
    assert out["turn"].cached_tokens == len(prompt) + len(g.output_ids) - 1
    # another agent with the same prompt: all of it but the last token
    assert out["other"].cached_tokens == len(prompt) - 1


def test_the_simulator_has_sglangs_meanings():
    prompt, ext = list(range(1, 301)), [7, 8, 9]

    async def main():
        eng = make_sim_engine("tiny-cpu", ToyTokenizer(), ScriptedModel(n=NEW + 10),
                              stats_refresh_decode_steps=0)  # fmt: skip
        try:
            return await scenario(eng, prompt, ext)
        finally:
            await eng.aclose()

    check(run_virtual(main()), prompt, ext)


@pytest.mark.slow
async def test_the_llama_cpp_engine_has_the_same_meanings():
    pytest.importorskip("llama_cpp")
    from runner.engines.llama_cpp import LlamaCppEngine

    # 16 slots: one busy slot is 1/16 of them, less than its cells' share of the pool, so U
    # is the cells' share here (where slots run out first, the engine's U is the busy slots'
    # share, as SGLang's scheduler stops at max_running_requests: docs/engines.md)
    eng = LlamaCppEngine(n_ctx=1024, n_threads=2, pool_tokens=2048, max_seqs=16)
    eos = eng.tokenizer.eos_ids
    eng.tokenizer._eos = frozenset()  # a fixed output length: EOS does not end a request here
    try:
        prompt = [100 + (i * 7) % 500 for i in range(300)]
        ext = eng.tokenizer.encode("\nNext turn.")
        out = await scenario(eng, prompt, ext)
    finally:
        eng.tokenizer._eos = eos
        await eng.aclose()
    assert len(out["gen"].output_ids) == NEW
    check(out, prompt, ext)
