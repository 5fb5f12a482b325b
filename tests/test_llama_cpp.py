"""The llama.cpp engine against the real llama-cpp-python and SmolLM2-135M: its capabilities,
its token log-probabilities, and the library behaviour its prefix-state cache relies on."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest
import pytest_asyncio

llama_cpp = pytest.importorskip("llama_cpp")

from runner.engine import (  # noqa: E402
    ConstrainedDecoding,
    Engine,
    SamplingParams,
    TokenLogprobs,
)
from runner.engines.llama_cpp import LlamaCppEngine, default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'


def _pinned_range() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("llama-cpp-python")]
    return spec.removeprefix("llama-cpp-python")


def test_installed_version_is_in_the_pinned_range():
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_pinned_range())
    assert llama_cpp.__version__ in spec, (llama_cpp.__version__, str(spec))
    assert re.search(r"<\s*\d", str(spec)), "the range needs an upper bound"


def test_the_bindings_the_engine_calls_exist():
    # llama.h bindings (ctypes functions) and the Llama members the engine reads and writes
    for name in (
        "llama_get_memory",
        "llama_memory_seq_rm",
        "llama_state_seq_get_size",
        "llama_state_seq_get_data",
        "llama_state_seq_set_data",
        "llama_get_logits_ith",
    ):
        assert callable(getattr(llama_cpp, name)), name
    for name in ("generate", "reset", "set_seed", "n_ctx", "n_vocab", "tokenize", "detokenize"):
        assert callable(getattr(llama_cpp.Llama, name)), name
    assert isinstance(llama_cpp.Llama.ctx, property)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def eng():
    e = LlamaCppEngine(n_ctx=1024, n_threads=2, cache_bytes=64 << 20)
    yield e
    await e.aclose()


def _gen(eng: LlamaCppEngine, ids: list[int], sp: SamplingParams):
    return eng._generate_sync(list(ids), sp)  # the worker's call, without an event loop


def _prompt(eng: LlamaCppEngine, text: str) -> list[int]:
    return eng.tokenizer.encode(eng.tokenizer.render([{"role": "user", "content": text}]))


@pytest.mark.slow
def test_capabilities(eng):
    assert isinstance(eng, Engine)
    assert isinstance(eng, ConstrainedDecoding) and eng.constrain_by_default
    assert isinstance(eng, TokenLogprobs) and eng.gives_logprobs
    assert not hasattr(eng, "constrains_tool_calls")


@pytest.mark.slow
def test_logprobs_are_the_raw_logits_of_each_sampled_position(eng):
    """Checked against an independent evaluation with logits kept for every position, fed as
    generate() feeds it (the prompt in one batch, then one token at a time: batching changes
    the logits in their third decimal): one value per output id, each the raw log-softmax of
    the row that produced it."""
    prompt = _prompt(eng, "Name three colours.")
    g = _gen(eng, prompt, SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=True))
    assert g.output_logprobs is not None
    assert len(g.output_logprobs) == len(g.output_ids) == 6

    ref = llama_cpp.Llama(
        model_path=str(default_model_path()), n_ctx=512, n_threads=2, logits_all=True,
        verbose=False,
    )  # fmt: skip
    try:
        ref.eval(prompt)
        for tok in g.output_ids[:-1]:
            ref.eval([tok])
        rows = llama_cpp.Llama.logits_to_logprobs(ref.scores[: ref.n_tokens])
    finally:
        ref.close()
    for i, (tok, lp) in enumerate(zip(g.output_ids, g.output_logprobs, strict=True)):
        row = rows[len(prompt) - 1 + i]
        assert int(row.argmax()) == tok  # greedy, unconstrained: the raw argmax
        assert lp == pytest.approx(float(row[tok]), abs=1e-4)
        assert lp <= 0.0


@pytest.mark.slow
def test_logprobs_when_sampled_and_constrained_and_only_when_asked(eng):
    prompt = _prompt(eng, "Call the tool.")
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8, seed=5,
                        tool_call_schema=SCHEMA, logprobs=True)  # fmt: skip
    g = _gen(eng, prompt, sp)
    assert g.output_logprobs is not None and len(g.output_logprobs) == len(g.output_ids)
    assert all(math.isfinite(x) and x <= 0.0 for x in g.output_logprobs)
    assert eng.tokenizer.decode(g.output_ids).startswith("<tool_call>"[: len(g.text)])
    assert _gen(eng, prompt, GREEDY).output_logprobs is None


def _cold(eng: LlamaCppEngine, ids: list[int]):
    """Greedy generation from an empty context and an empty state cache."""
    eng.cache.clear()
    eng._llm.reset()
    g = _gen(eng, ids, GREEDY)
    assert g.cached_tokens == 0
    return g


@pytest.mark.slow
def test_a_restored_state_generates_as_a_cold_context(eng):
    """The prefix-state cache loads a saved sequence into llama.cpp and hands Llama.generate
    the live prefix through its public n_tokens / input_ids. The output must be a cold
    context's, also when the prompt is exactly a saved state's tokens: the logits in the
    context then belong to another sequence and must not be sampled from."""
    p = _prompt(eng, "Say hello.")
    other = _prompt(eng, "Count to five, slowly, please.")
    out = _cold(eng, p).output_ids
    # The state saved after that call: the tokens evaluated, i.e. all but the last output
    exact = [int(t) for t in eng._llm.input_ids[: eng._llm.n_tokens]]
    assert exact == p + out[:-1] and [len(k) for k in eng.cache._states] == [len(exact)]
    want = _cold(eng, exact).output_ids

    eng.cache.clear()
    _gen(eng, p, GREEDY)  # saves exactly `exact`
    _gen(eng, other, GREEDY)  # the live sequence (and its logits) is now another prompt's
    g = _gen(eng, exact, GREEDY)
    assert g.cached_tokens == len(exact) - 1  # served from the saved state
    assert g.output_ids == want

    longer = exact + eng.tokenizer.encode(" Zebra quartz!")
    want = _cold(eng, longer).output_ids
    eng.cache.clear()
    _gen(eng, p, GREEDY)
    _gen(eng, other, GREEDY)
    g = _gen(eng, longer, GREEDY)  # the saved state, then the new tokens
    assert g.cached_tokens == len(exact)
    assert g.output_ids == want


# ---- failures and sampling options ------------------------------------------------------


@pytest.mark.slow
async def test_a_context_overflow_inside_llama_cpp_is_a_permanent_context_limit():
    """What llama-cpp-python raises past n_ctx (llama_decode returns 1: no KV slot) is a
    ContextLimitExceeded, failed at once; the engine serves the next request."""

    from runner import retries
    from runner.engine import ContextLimitExceeded

    e = LlamaCppEngine(n_ctx=256, n_threads=2, cache_bytes=16 << 20)
    try:
        e.context_limit = 100_000  # past the adapter's own check: the library's own failure
        calls = []
        real = e.generate

        async def counted(ids, sp, *, agent=None):
            calls.append(1)
            return await real(ids, sp, agent=agent)

        e.generate = counted  # type: ignore[method-assign]
        prompt = e.tokenizer.encode("word " * 300)
        assert len(prompt) > 256
        policy = retries.RetryPolicy(initial_wait=0.01)
        with pytest.raises(ContextLimitExceeded, match="llama_decode returned 1") as err:
            await retries.generate(e, prompt, GREEDY, "a", policy)
        assert calls == [1] and not retries.is_transient(err.value)
        e.context_limit = 256
        assert _gen(e, _prompt(e, "Hi."), GREEDY).output_ids
    finally:
        await e.aclose()


@pytest.fixture
async def extras_engine():
    e = LlamaCppEngine(n_ctx=256, n_threads=1, sampling_extra={"top_k": 5, "min_p": 0.1})
    yield e
    await e.aclose()


@pytest.mark.slow
def test_sampling_extras_are_checked_against_llama_generate(tmp_path, capsys, extras_engine):
    # a synchronous test: run.py's main below owns its event loop, as in production
    from runner.cli.main import main
    from runner.engine import SamplingCheck

    e = extras_engine
    assert isinstance(e, SamplingCheck)
    e.check_sampling(GREEDY)
    sent, real = [], e._llm.generate

    def recorded(*args, **kwargs):
        sent.append(kwargs)
        return real(*args, **kwargs)

    e._llm.generate = recorded
    _gen(e, _prompt(e, "Hi."), SamplingParams(temperature=0.7, max_new_tokens=2))
    assert (sent[0]["top_k"], sent[0]["min_p"], sent[0]["temp"]) == (5, 0.1, 0.7)
    e._llm.generate = real
    for extra, message in (
        ({"top_kk": 5}, r"--sampling-arg top_kk: .*\(did you mean top_k\?\)"),
        ({"temp": 0.5}, "--sampling-arg temp: not a sampling parameter"),  # the engine's
        ({"top_k": 2.5}, r"--sampling-arg top_k=2\.5: llama.cpp takes an int"),
        ({"penalize_nl": 1}, "penalize_nl=1: llama.cpp takes a bool"),
    ):
        e._sampling_extra = extra
        with pytest.raises(ValueError, match=message):
            e.check_sampling(GREEDY)
    # through the command line: one error before any agent, exit 2
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "prompt": "p"}\n')
    argv = ["--tasks", str(path), "--out", str(tmp_path / "out"), "--engine", "llama.cpp"]
    argv += ["--n-ctx", "256", "--sandbox", "none", "--sampling-arg", "min-p=0.2x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sampling options: --sampling-arg min_p='0.2x': llama.cpp takes a float" in err
    assert not (tmp_path / "out" / "trajectories.jsonl").exists()
