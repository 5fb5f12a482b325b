"""The batched llama.cpp engine against the real llama-cpp-python and SmolLM2-135M: batching,
the pool (eviction, preemption, recompute), prefix sharing, grammar, logprobs, failures."""

from __future__ import annotations

import asyncio
import json
import math
import tomllib
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from runner.engines.llama_cpp import LlamaCppEngine, default_model_path, native  # noqa: E402
from runner.engines.protocol import (  # noqa: E402
    ConstrainedDecoding,
    ContextLimitExceeded,
    Engine,
    EngineStats,
    SamplingCheck,
    SamplingParams,
    TokenLogprobs,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'


def test_installed_version_is_the_pinned_one():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("llama-cpp-python")]
    assert spec == f"llama-cpp-python=={native.PINNED_VERSION}"
    assert llama_cpp.__version__ == native.PINNED_VERSION
    lock = (ROOT / "constraints.txt").read_text().splitlines()
    assert f"llama-cpp-python=={native.PINNED_VERSION}" in lock


def test_the_bindings_the_engine_calls_exist():
    for name in (
        "llama_model_load_from_file", "llama_init_from_model", "llama_batch_init",
        "llama_decode", "llama_get_memory", "llama_memory_seq_rm", "llama_memory_seq_cp",
        "llama_get_logits_ith", "llama_sampler_chain_init", "llama_sampler_init_grammar",
        "llama_sampler_sample", "llama_print_system_info", "llama_max_parallel_sequences",
    ):  # fmt: skip
        assert callable(getattr(llama_cpp, name)), name
    fields = {f for f, _ in llama_cpp.llama_model_params._fields_}
    assert "use_extra_bufts" in fields
    assert {"kv_unified", "n_seq_max"} <= {f for f, _ in llama_cpp.llama_context_params._fields_}


def _engine(**kw):
    opts = {"n_ctx": 2048, "n_threads": 2, "pool_tokens": 4096, "max_seqs": 8, **kw}
    return LlamaCppEngine(**opts)


def _prompt(eng, text: str) -> list[int]:
    return eng.tokenizer.encode(eng.tokenizer.render([{"role": "user", "content": text}]))


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
TEXTS = [f"Tell me about the number {i}, in one sentence." for i in range(8)]


@pytest.mark.slow
async def test_capabilities_and_the_load_choice_on_this_machine():
    e = _engine()
    try:
        assert isinstance(e, Engine) and isinstance(e, EngineStats)
        assert isinstance(e, ConstrainedDecoding) and e.constrain_by_default
        assert isinstance(e, TokenLogprobs) and e.gives_logprobs
        assert isinstance(e, SamplingCheck)
        want = native.load_choice(native.system_info(), native.cpu_flags())
        assert e.load == want  # on an AMX machine with an AMX build: off (it segfaults on)
        assert e.pool.capacity >= 4096 and e.context_limit == 2048
    finally:
        await e.aclose()


@pytest.mark.slow
async def test_greedy_tokens_are_the_same_alone_in_a_batch_and_through_a_tiny_pool():
    """One request at a time in a big pool, eight at once, and eight at once in a pool that
    holds two of them (eviction, preemption, recompute): the same greedy tokens. llama.cpp's
    arithmetic depends on the batch shape; where a token differs, the logprobs of the first
    differing position must be within 0.05 (measured: none differed)."""
    big = _engine(pool_tokens=8192)
    try:
        prompts = [_prompt(big, t) for t in TEXTS]
        sp = SamplingParams(temperature=0.0, max_new_tokens=24, logprobs=True)
        alone = [await big.generate(p, sp, agent=f"a{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*[big.generate(p, sp) for p in prompts])
    finally:
        await big.aclose()
    tiny = _engine(pool_tokens=256, max_seqs=4)
    try:
        squeezed = await asyncio.gather(*[tiny.generate(p, sp) for p in prompts])
        st = tiny.stats()
        tiny.pool.check()
    finally:
        await tiny.aclose()
    assert st["preemptions"] + st["evictions"] > 0, st
    for a, b, c in zip(alone, together, squeezed, strict=True):
        for other in (b, c):
            if other.output_ids != a.output_ids:
                pairs = zip(a.output_ids, other.output_ids, strict=False)
                k = next(i for i, (x, y) in enumerate(pairs) if x != y)
                assert abs(a.output_logprobs[k] - other.output_logprobs[k]) < 0.05
    same = sum(b.output_ids == a.output_ids for a, b in zip(alone, together, strict=True))
    assert same >= 6, same


@pytest.mark.slow
async def test_a_turn_reuses_the_agents_cells_and_copies_share_a_prefix():
    e = _engine()
    try:
        p = _prompt(e, "Say hello.")
        g = await e.generate(p, GREEDY, agent="a")
        nxt = p + g.output_ids + e.tokenizer.encode("<|im_start|>user\nAgain.<|im_end|>\n")
        g2 = await e.generate(nxt, GREEDY, agent="a")
        assert g2.cached_tokens == len(p) + len(g.output_ids) - 1  # all but the last output
        g3 = await e.generate(p, GREEDY, agent="b")  # another agent, the same prompt
        assert g3.cached_tokens == len(p) - 1 and g3.output_ids == g.output_ids
        before = e.pool.used
        await e.end_agent("a")
        await asyncio.sleep(0.3)
        assert e.pool.used < before
        e.pool.check()
    finally:
        await e.aclose()


@pytest.mark.slow
async def test_usage_counts_running_requests_only():
    e = _engine()
    try:
        p = _prompt(e, "Count to twenty.")
        task = asyncio.create_task(e.generate(p, SamplingParams(max_new_tokens=64)))
        seen = []
        while not task.done():
            await asyncio.sleep(0.05)
            seen.append(e.cache_stats())
        await task
        await asyncio.sleep(0.2)
        busy = max(s.usage for s in seen)
        assert busy > len(p) / e.pool.capacity * 0.9
        idle = e.cache_stats()
        assert idle.usage == 0 and idle.extra["physical_occupancy"] > 0  # idle cells kept
        assert idle.resident_limit == len(e.pool.slots)  # a context per sequence slot
    finally:
        await e.aclose()


@pytest.mark.slow
async def test_concurrent_grammar_requests_each_make_a_valid_call():
    e = _engine()
    try:
        schema = json.dumps({"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "enum": ["bash", "submit"]}}})  # fmt: skip
        sps = [SamplingParams(temperature=0.5, max_new_tokens=200, tool_call_schema=schema,
                              seed=i, logprobs=True) for i in range(6)]  # fmt: skip
        gs = await asyncio.gather(*[e.generate(_prompt(e, "Call the tool."), sp) for sp in sps])
        for g in gs:
            assert g.finish_reason == "stop", g
            assert g.text.startswith("<tool_call>") and g.text.endswith("</tool_call>"), g.text
            assert "name" in json.loads(
                g.text.removeprefix("<tool_call>").removesuffix("</tool_call>")
            )
            assert len(g.output_logprobs) == len(g.output_ids)
            assert all(math.isfinite(x) and x <= 0 for x in g.output_logprobs)
    finally:
        await e.aclose()


@pytest.mark.slow
async def test_a_grammar_redraw_over_the_top_logits_equals_one_over_the_whole_vocabulary():
    """A token the grammar rejects is drawn again over the 256 highest logits when enough of
    them are valid: the same tokens as over the whole vocabulary, greedy and seeded draws."""
    schema = json.dumps({"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string"}}})  # fmt: skip
    sps = [SamplingParams(temperature=t, max_new_tokens=40, tool_call_schema=schema, seed=3)
           for t in (0.0, 0.8)]  # fmt: skip
    outs = []
    for whole in (False, True):
        e = _engine()
        if whole:
            e._enough = lambda sp: None  # type: ignore[method-assign]
        try:
            p = _prompt(e, "List the files.")
            outs.append([(await e.generate(p, sp)).output_ids for sp in sps])
            outs.append(e.stats()["grammar_resamples"])
        finally:
            await e.aclose()
    top, n_top, whole, n_whole = outs
    assert n_top == n_whole > 0  # the redraw path was taken
    assert top == whole


@pytest.mark.slow
async def test_the_grammar_mask_is_the_whole_vocabulary_pass_and_depends_on_the_text_only():
    """The engine's valid-token mask (byte tokens first, then the tokens they allow) equals
    the grammar over the whole vocabulary at every state of a walk through a call, through
    fixed text, a non-ASCII string and its split UTF-8 bytes; and two spellings of one text
    (one token each, or one byte each) reach states with the same mask, so masks are kept
    by the accepted bytes."""
    import ctypes
    import random

    import numpy as np

    e = _engine()
    lc = e._lc
    schema = json.dumps({"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string", "enum": ["bash"]},
        "arguments": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "string"}}}}})  # fmt: skip
    vocab = lc.llama_model_get_vocab(e._model)

    def grammar():
        return lc.llama_sampler_init_grammar(vocab, e._grammar(schema), b"root")

    def whole(g):
        arr = e._candidates(e._zeros)
        lc.llama_sampler_apply(g, ctypes.byref(arr))
        return np.isfinite(e._cand["logit"]).copy()

    try:
        rng = random.Random(7)
        g = grammar()
        e._valid(g)  # reads the vocabulary's first bytes
        said, non_ascii, split = b"", 0, 0

        def step(tok):
            nonlocal said, split
            try:
                said.decode()
            except UnicodeDecodeError:
                split += 1  # a character's bytes not all accepted yet
            mask = e._valid(g)
            assert (mask == whole(g)).all(), said
            assert mask[tok], (said, tok)
            lc.llama_sampler_accept(g, tok)
            said += e.tokenizer.piece(tok)

        for t in e.tokenizer.encode('<tool_call>{"name": "bash", "arguments": {"command": "'):
            step(t)
        for _ in range(40):  # inside the string: half the tokens non-ASCII, none ending it
            valid = [int(t) for t in np.flatnonzero(e._valid(g) & ~e._eog)
                     if b'"' not in e.tokenizer.piece(int(t))]  # fmt: skip
            wide = [t for t in valid if max(e.tokenizer.piece(t)) >= 0x80]
            tok = rng.choice(wide) if rng.random() < 0.5 else rng.choice(valid)
            non_ascii += tok in wide
            step(tok)
        for t in e.tokenizer.encode('"}}</tool_call>'):
            step(t)
        assert e._valid(g).sum() == e._eog.sum()  # the call is complete: only the end
        assert non_ascii >= 15 and split >= 3, (split, said)
        lc.llama_sampler_free(g)

        text = '<tool_call>{"name": "bash", "arguments": {"command": "ls été'
        whole_tokens = e.tokenizer.encode(text)
        by_byte = {e.tokenizer.piece(t): t for t in range(e.tokenizer.n_vocab)
                   if len(e.tokenizer.piece(t)) == 1}  # fmt: skip
        one_byte = [by_byte[bytes([b])] for b in text.encode()]
        assert len(whole_tokens) < len(one_byte)
        ends = []
        for toks in (whole_tokens, one_byte):
            g = grammar()
            for t in toks:
                assert e._valid(g)[t]
                lc.llama_sampler_accept(g, t)
            ends.append(e._valid(g))
            lc.llama_sampler_free(g)
        assert (ends[0] == ends[1]).all() and 100 < ends[0].sum() < e.tokenizer.n_vocab
    finally:
        await e.aclose()


@pytest.mark.slow
async def test_logprobs_are_the_raw_logits_of_each_sampled_position():
    e = _engine()
    try:
        p = _prompt(e, "Name three colours.")
        g = await e.generate(p, SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=True))
    finally:
        await e.aclose()
    rows = _reference_logprobs(p + g.output_ids[:-1], prompt=len(p))
    for i, (tok, lp) in enumerate(zip(g.output_ids, g.output_logprobs, strict=True)):
        row = rows[len(p) - 1 + i]
        assert int(row.argmax()) == tok
        assert lp == pytest.approx(float(row[tok]), abs=2e-2)


def _reference_logprobs(ids: list[int], prompt: int):
    """An independent evaluation: one sequence, the low-level API, logits at every position,
    computed in the engine's shapes: the prompt in one batch, then one token per decode
    (llama.cpp's arithmetic depends on the batch shape: a one-batch evaluation of the same
    ids moved these logprobs by up to 0.11). The model is loaded as the engine loads it
    (Llama's own loader would take the AMX path), attention without flash attention."""
    import numpy as np

    from runner.engines.llama_cpp.batch import NativeBatch

    m = native.load_model(default_model_path(),
                          native.load_choice(native.system_info(), native.cpu_flags()))  # fmt: skip
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 512, 512, 2, 2
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(m, cp)
    b = NativeBatch(512)
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m))
        rows = []

        def decode(part: list[tuple[int, int]]) -> None:
            b.fill([(t, i, 0, True) for i, t in part])
            assert llama_cpp.llama_decode(ctx, b.struct) == 0
            for k in range(len(part)):
                x = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, k), shape=(n_vocab,))
                x = x.astype(np.float64)
                rows.append(x - x.max() - np.log(np.exp(x - x.max()).sum()))

        decode(list(enumerate(ids[:prompt])))
        for i in range(prompt, len(ids)):
            decode([(i, ids[i])])
        return rows
    finally:
        b.close()
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(m)


@pytest.mark.slow
async def test_a_request_larger_than_the_pool_fails_alone_and_a_cancel_frees_cells():
    e = _engine(pool_tokens=256, n_ctx=100_000)
    try:
        big = e.tokenizer.encode("word " * 400)
        small = _prompt(e, "Hi.")
        long = asyncio.create_task(e.generate(small, SamplingParams(max_new_tokens=200)))
        res = await asyncio.gather(e.generate(big, GREEDY), e.generate(small, GREEDY),
                                   return_exceptions=True)  # fmt: skip
        assert isinstance(res[0], ContextLimitExceeded) and "pool" in str(res[0])
        assert res[1].completion_tokens > 0
        await asyncio.sleep(0.3)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        await asyncio.sleep(0.3)
        assert e.cache_stats().used_tokens == 0
        e.pool.check()
    finally:
        await e.aclose()


def test_sampling_extras_are_checked():
    e = LlamaCppEngine.__new__(LlamaCppEngine)  # check_sampling reads only the extras
    for extra, message in (
        ({"top_kk": 5}, r"--sampling-arg top_kk: .*\(did you mean top_k\?\)"),
        ({"temp": 0.5}, "--sampling-arg temp: not a sampling parameter"),
        ({"top_k": 2.5}, r"--sampling-arg top_k=2\.5: llama.cpp takes an int"),
        ({"min_p": "x"}, "min_p='x': llama.cpp takes a float"),
    ):
        e._sampling_extra = extra
        with pytest.raises(ValueError, match=message):
            e.check_sampling(GREEDY)
    e._sampling_extra = {"top_k": 5, "min_p": 0.1}
    e.check_sampling(GREEDY)
