"""The SGLang adapter against a test double of SGLang's documented surface (fast, offline).

tests/support/sglang_double.py is NOT SGLang: it reproduces the calls, keys and behaviours
the adapter relies on, as read from SGLang's source. bench/sglang_check.py checks the real
thing on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from runner.agent.agent import Agent
from runner.agent.retries import is_transient
from runner.engines import sglang as sg
from runner.engines.protocol import (
    CacheStats,
    ConstrainedDecoding,
    ContextLimitExceeded,
    DataParallel,
    Engine,
    EngineError,
    SamplingCheck,
    SamplingParams,
    Tokenizer,
    TokenLogprobs,
    TransientEngineError,
)
from runner.engines.sglang import SGLangEngine, SGLangTokenizer, parse_engine_args, sglang_available
from runner.engines.sglang import args as sg_args
from runner.engines.sglang import versions as sg_versions
from runner.gate.gate import Gate
from runner.tasks.tasks import Task
from tests.support.sglang_double import (
    BOS_ID,
    EOS_ID,
    EOT_ID,
    Abort,
    FakeLoad,
    HTTPException,
    Reply,
    fake_logprob,
    install_fake_sglang,
)
from tools.core import Observation, ToolContext
from tools.submit import Submit

SP = SamplingParams(temperature=0.6, top_p=0.95, max_new_tokens=64, stop=("</tool_call>",))


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """sessions=True may set SGLANG_ENABLE_UNIFIED_RADIX_TREE; undo it after each test."""
    monkeypatch.setenv(sg_versions.UNIFIED_TREE_ENV, "")
    monkeypatch.delenv(sg_versions.UNIFIED_TREE_ENV)


def make(monkeypatch, *, config: dict | None = None, **kw: Any) -> tuple[SGLangEngine, Any]:
    handle = install_fake_sglang(monkeypatch, **(config or {}))
    eng = SGLangEngine("fake/model", **kw)
    return eng, handle.engine


# ---- construction -----------------------------------------------------------------------


def test_constructor_passes_server_args_and_implements_the_protocol(monkeypatch):
    eng, fk = make(
        monkeypatch,
        tp_size=2,
        dp_size=2,
        mem_fraction_static=0.8,
        engine_args={"enable_hierarchical_cache": True, "hicache_ratio": 2.0},
    )
    assert fk.kwargs == {
        "model_path": "fake/model",
        "tp_size": 2,
        "dp_size": 2,
        "mem_fraction_static": 0.8,
        "enable_hierarchical_cache": True,
        "hicache_ratio": 2.0,
    }
    assert isinstance(eng, Engine)
    assert isinstance(eng.tokenizer, Tokenizer)
    assert eng.name == "sglang" and eng.model == "fake/model"
    assert eng.context_limit == 4096  # tokenizer_manager.context_len


def test_unset_server_args_are_not_sent(monkeypatch):
    _, fk = make(monkeypatch)
    assert fk.kwargs == {"model_path": "fake/model"}


def test_unknown_server_arg_is_a_clear_engine_error(monkeypatch):
    with pytest.raises(EngineError, match=r"rejected the server arguments.*no_such_flag"):
        make(monkeypatch, engine_args={"no_such_flag": 1})


def test_conflicting_server_args_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="tp_size"):
        make(monkeypatch, tp_size=2, engine_args={"tp_size": 4})
    with pytest.raises(ValueError, match="enable_session_radix_cache"):
        make(monkeypatch, sessions=True, engine_args={"enable_session_radix_cache": False})


def test_logprob_options_cannot_sneak_in(monkeypatch):
    with pytest.raises(ValueError, match="logprob"):
        make(monkeypatch, sampling_extra={"logprob_start_len": 0})
    with pytest.raises(ValueError, match="owns"):
        make(monkeypatch, sampling_extra={"max_new_tokens": 5})


def test_sglang_missing_is_a_clear_engine_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(EngineError) as e:
        SGLangEngine("some/model")
    assert "pip install 'concur-runner[sglang]'" in str(e.value)
    assert "pip install sglang" in str(e.value)


def test_engine_factory_injection(monkeypatch):
    handle = install_fake_sglang(monkeypatch)
    monkeypatch.setitem(sys.modules, "sglang", None)  # the factory is used, not the import
    eng = SGLangEngine("m", engine_factory=handle.engine_class)
    assert eng.context_limit == 4096


def test_skip_tokenizer_init_is_refused(monkeypatch):
    with pytest.raises(EngineError, match="tokenizer"):
        make(monkeypatch, engine_args={"skip_tokenizer_init": True})


# ---- parse_engine_args ------------------------------------------------------------------


def test_parse_engine_args_types():
    got = parse_engine_args(
        [
            "tp_size=2",
            "mem-fraction-static=0.85",
            "--enable-hierarchical-cache=true",
            "disable_radix_cache=False",
            "hicache_write_policy=write_through",
            "chunked_prefill_size=-1",
            "max_total_tokens=none",
            "served_model_name='7'",
            'json_model_override_args={"a": 1}',
            "tool_call_parser=",
        ]
    )
    assert got == {
        "tp_size": 2,
        "mem_fraction_static": 0.85,
        "enable_hierarchical_cache": True,
        "disable_radix_cache": False,
        "hicache_write_policy": "write_through",
        "chunked_prefill_size": -1,
        "max_total_tokens": None,
        "served_model_name": "7",
        "json_model_override_args": '{"a": 1}',
        "tool_call_parser": "",
    }
    assert isinstance(got["tp_size"], int) and isinstance(got["enable_hierarchical_cache"], bool)
    assert parse_engine_args([]) == {} and parse_engine_args(None) == {}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("tp_size", "expected KEY=VALUE"),
        ("=3", "key is empty"),
        ("tp size=2", "not a valid argument name"),
        ("9lives=1", "not a valid argument name"),
    ],
)
def test_parse_engine_args_errors(item, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_engine_args([item])
    assert "--engine-arg" in str(e.value)


def test_parse_engine_args_duplicates():
    with pytest.raises(ValueError, match="given twice"):
        parse_engine_args(["tp_size=2", "tp-size=4"])


# ---- generation -------------------------------------------------------------------------


async def test_ids_sent_are_exactly_the_ids_given_and_output_ids_come_back(monkeypatch):
    eng, fk = make(monkeypatch, config={"replies": [Reply("hello")]})
    ids = eng.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    before = list(ids)
    gen = await eng.generate(ids, SP)
    assert fk.calls[0]["input_ids"] == before and ids == before  # sent as given, not mutated
    assert gen.output_ids == [*eng.tokenizer.encode("hello"), EOT_ID]  # EOS kept
    assert gen.text == "hello"
    assert gen.stopped_on_eos and gen.finish_reason == "stop"
    assert gen.prompt_tokens == len(ids) and gen.completion_tokens == 6
    assert gen.seconds == 0.05  # meta_info["e2e_latency"]


async def test_sampling_params_mapped_and_no_logprob_options(monkeypatch):
    eng, fk = make(monkeypatch, sampling_extra={"top_k": 20, "repetition_penalty": 1.1})
    await eng.generate([200, 201, 202], SP)
    call = fk.calls[0]
    assert call["sampling_params"] == {
        "max_new_tokens": 64,
        "temperature": 0.6,
        "top_p": 0.95,
        "stop": ["</tool_call>"],
        "stop_token_ids": sorted({EOS_ID, EOT_ID}),
        "top_k": 20,
        "repetition_penalty": 1.1,
    }
    assert call["return_logprob"] is False and call["logprob_start_len"] is None
    assert call["top_logprobs_num"] is None and call["token_ids_logprob"] is None
    # nothing that changes the radix key is sent either
    assert call["lora_path"] is None and call["cache_salt"] is None
    assert call["stream"] is False and call["prompt"] is None


async def test_logprobs_asked_for_come_back_one_per_output_token(monkeypatch):
    eng, fk = make(monkeypatch, config={"replies": [Reply("hi"), Reply("yo")]})
    sp = SamplingParams(max_new_tokens=16, logprobs=True)
    gen = await eng.generate([200, 201], sp)
    call = fk.calls[0]
    assert call["return_logprob"] is True
    # only return_logprob: a logprob_start_len inside the prompt would cap the prefix match
    assert call["logprob_start_len"] is None and call["top_logprobs_num"] is None
    assert call["token_ids_logprob"] is None
    assert gen.output_ids == [*eng.tokenizer.encode("hi"), EOT_ID]
    assert gen.output_logprobs == [fake_logprob(t) for t in gen.output_ids]
    plain = await eng.generate([200, 201, 202], SP)  # not asked: none sent, none given
    assert fk.calls[1]["return_logprob"] is False and plain.output_logprobs is None


async def test_logprobs_that_do_not_match_the_output_fail_the_request(monkeypatch):
    handle = install_fake_sglang(monkeypatch)

    class Short(handle.engine_class):
        async def async_generate(self, *args, **kwargs):
            out = await super().async_generate(*args, **kwargs)
            out["meta_info"]["output_token_logprobs"].pop()
            return out

    eng = SGLangEngine("m", engine_factory=Short)
    with pytest.raises(EngineError, match="output logprobs for 3 output tokens"):
        await eng.generate([200], SamplingParams(logprobs=True))
    assert eng.cache_stats().extra["failed"] == 1


async def test_logprobs_refused_where_async_generate_cannot_return_them(monkeypatch):
    handle = install_fake_sglang(monkeypatch)

    class Old(handle.engine_class):
        async def async_generate(self, prompt=None, sampling_params=None, input_ids=None):
            return await super().async_generate(prompt, sampling_params, input_ids)

    eng = SGLangEngine("m", engine_factory=Old)
    assert isinstance(eng, TokenLogprobs) and not eng.gives_logprobs
    with pytest.raises(EngineError, match="return_logprob"):
        await eng.generate([200], SamplingParams(logprobs=True))
    assert (await eng.generate([200], SP)).output_logprobs is None


async def test_a_sampling_key_sglang_rejects_fails_the_request(monkeypatch):
    eng, _ = make(monkeypatch, sampling_extra={"topk": 20})  # a typo of top_k
    with pytest.raises(EngineError, match="Unexpected keyword argument 'topk'"):
        await eng.generate([200], SP)


def test_sampling_is_checked_once_through_sglangs_own_sampling_params(monkeypatch):
    eng, fk = make(monkeypatch, sampling_extra={"top_k": 20, "min_p": 0.05})
    assert isinstance(eng, SamplingCheck)
    eng.check_sampling(SP)  # accepted: nothing sent
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        eng.check_sampling(SamplingParams(top_p=0.0))
    assert fk.calls == []
    eng, _ = make(monkeypatch, sampling_extra={"topk": 20})  # a typo of top_k
    with pytest.raises(ValueError, match=r"--sampling-arg topk: .*\(did you mean top_k\?\)"):
        eng.check_sampling(SP)
    eng, _ = make(monkeypatch, sampling_extra={"top_k": 0})
    with pytest.raises(ValueError, match=r"top_k=0.*top_k must be -1 \(disable\) or at least 1"):
        eng.check_sampling(SP)
    eng, _ = make(monkeypatch, sampling_extra={"stop_strs": ["x"]})  # SGLang's own field
    with pytest.raises(ValueError, match="--sampling-arg stop_strs: not a sampling parameter"):
        eng.check_sampling(SP)
    # a second constraint only clashes where tool calls are constrained
    eng, _ = make(monkeypatch, sampling_extra={"regex": "[a-z]+"})
    eng.check_sampling(SP)
    with pytest.raises(ValueError, match="--sampling-arg regex and constrained tool calls"):
        eng.check_sampling(SamplingParams(tool_call_schema='{"type": "object"}'))


CALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"const": "submit"}, "arguments": {"type": "object"}},
    "required": ["name", "arguments"],
}


async def test_tool_call_schema_becomes_one_structural_tag(monkeypatch):
    eng, fk = make(monkeypatch)
    sp = SamplingParams(max_new_tokens=32, tool_call_schema=json.dumps(CALL_SCHEMA))
    await eng.generate([200, 201], sp)
    await eng.generate([200, 201, 202], sp)
    first, second = (c["sampling_params"] for c in fk.calls)
    assert json.loads(first["structural_tag"]) == {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<tool_call>",
            "content": {"type": "json_schema", "json_schema": CALL_SCHEMA},
            "end": "</tool_call>",
        },
    }
    assert first["structural_tag"] is second["structural_tag"]  # built once per schema
    assert isinstance(eng, ConstrainedDecoding)
    # without a schema nothing constrains the reply
    await eng.generate([200], SP)
    assert "structural_tag" not in fk.calls[-1]["sampling_params"]


async def test_a_second_constraint_from_sampling_args_is_refused(monkeypatch):
    eng, fk = make(monkeypatch, sampling_extra={"regex": "[a-z]+"})
    sp = SamplingParams(tool_call_schema=json.dumps(CALL_SCHEMA))
    with pytest.raises(EngineError, match="--sampling-arg regex"):
        await eng.generate([200, 201], sp)
    assert not fk.calls  # refused before anything reached the engine
    await eng.generate([200, 201], SP)  # unconstrained requests still carry the extra
    assert fk.calls[-1]["sampling_params"]["regex"] == "[a-z]+"


def test_capabilities_are_the_protocols(monkeypatch):
    eng, _ = make(monkeypatch, dp_size=2)
    assert isinstance(eng, Engine)
    assert isinstance(eng, DataParallel) and eng.dp_size == 2
    assert isinstance(eng, TokenLogprobs) and eng.gives_logprobs
    # constrained decoding is offered, but not on by default: a forced call would also
    # forbid a reasoning model's <think> block
    assert isinstance(eng, ConstrainedDecoding) and eng.constrain_by_default is False
    assert not hasattr(eng, "constrains_tool_calls")


async def test_stop_string_reply_keeps_its_tokens_and_is_not_an_eos(monkeypatch):
    call = '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    eng, _ = make(monkeypatch, config={"replies": [Reply(call + " trailing")]})
    gen = await eng.generate([300, 301], SP)
    assert gen.text == call  # decoded from output_ids: the stop string is in them
    assert gen.output_ids == eng.tokenizer.encode(call)
    assert gen.finish_reason == "stop" and not gen.stopped_on_eos


async def test_length_finish(monkeypatch):
    eng, _ = make(monkeypatch, config={"replies": [Reply("x" * 100)]})
    gen = await eng.generate([300, 301], SamplingParams(max_new_tokens=10))
    assert gen.finish_reason == "length" and len(gen.output_ids) == 10
    assert not gen.stopped_on_eos


async def test_prefix_cache_accounting_and_hicache_split(monkeypatch):
    eng, _ = make(
        monkeypatch,
        engine_args={"enable_hierarchical_cache": True},
        config={"host_fraction": 0.25},
    )
    ids = list(range(200, 240))
    g1 = await eng.generate(ids, SP)
    assert g1.cached_tokens == 0 and g1.cached_host_tokens == 0
    ids2 = ids + g1.output_ids + list(range(400, 420))
    g2 = await eng.generate(ids2, SP)
    hit = len(ids) + len(g1.output_ids)
    assert g2.prompt_tokens == len(ids2) and g2.cached_tokens == hit
    assert g2.cached_host_tokens == int(hit * 0.25)  # cached_tokens_details["host"]
    extra = eng.cache_stats().extra
    assert extra["prompt_tokens"] == len(ids) + len(ids2)
    assert extra["cached_tokens"] == hit and extra["cached_host_tokens"] == int(hit * 0.25)


async def test_no_details_without_hicache(monkeypatch):
    eng, _ = make(monkeypatch)
    await eng.generate([200, 201, 202], SP)
    g = await eng.generate([200, 201, 202, 203], SP)
    assert g.cached_tokens == 3 and g.cached_host_tokens == 0


async def test_abort_is_an_engine_error(monkeypatch):
    eng, _ = make(monkeypatch, config={"replies": [Abort("The request queue is full.")]})
    with pytest.raises(EngineError, match="queue is full") as e:
        await eng.generate([200, 201], SP)
    assert not isinstance(e.value, ContextLimitExceeded)
    assert eng.cache_stats().extra["aborted"] == 1


OOM = "Out of memory even after retracting all other requests in the decode batch."
RETRACTED = "Retracted under decode memory pressure without a KV backup. Retry later."
TOO_LONG = "Input length (9000 tokens) exceeds the maximum allowed length (8192 tokens)."


@pytest.mark.parametrize(
    "reply,kind",
    [
        (Abort(), TransientEngineError),  # an AbortReq in the waiting queue: a result
        (Abort("Aborted"), TransientEngineError),
        (Abort(OOM, status_code=500), TransientEngineError),  # raised as HTTPException
        (Abort(RETRACTED, status_code=503), TransientEngineError),
        (Abort("request timed out (SLA)", status_code=503), TransientEngineError),
        (ConnectionResetError("zmq socket reset"), TransientEngineError),
        (TimeoutError("no answer"), TransientEngineError),
        (Abort("invalid stop_regex '('", status_code=400), EngineError),  # raised ValueError
        (Abort(TOO_LONG, status_code=400), ContextLimitExceeded),
        (HTTPException(status_code=404, detail="no such LoRA adapter"), EngineError),
        (ValueError("top_k must be -1 (disable) or at least 1, got 0."), EngineError),
        (TypeError("Unexpected keyword argument 'topk'"), EngineError),
        # 0.5.9 raises only 400, 500 and 503; other statuses come back in the result
        (Abort("too many requests", status_code=429, returned=True), TransientEngineError),
        (Abort("no such adapter", status_code=404, returned=True), EngineError),
    ],
)
async def test_aborts_and_failures_are_transient_or_permanent(monkeypatch, reply, kind):
    eng, _ = make(monkeypatch, config={"replies": [reply]})
    with pytest.raises(EngineError) as e:
        await eng.generate([200, 201], SP)
    assert type(e.value) is kind
    assert is_transient(e.value) == (kind is TransientEngineError)
    assert eng.cache_stats().extra["transient"] == (kind is TransientEngineError)


async def test_engine_exceptions_become_engine_errors(monkeypatch):
    class Unknown(Exception):  # anything else the tokenizer manager may raise
        pass

    eng, _ = make(
        monkeypatch,
        config={"replies": [Unknown("503"), ValueError("bad token id"), RuntimeError("x")]},
    )
    for _ in range(3):
        with pytest.raises(EngineError) as e:
            await eng.generate([200, 201], SP)
        assert type(e.value) is EngineError  # permanent: not retried


def _sglang_batch(monkeypatch, tmp_path, replies, n_tasks):
    """A real batch (and its summary) over the SGLang double: -> (summary, the double)."""
    from runner.batch.batch import Batch, BatchConfig
    from runner.batch.session import execute
    from runner.policies.baselines import NoGate
    from runner.runfolder.store import RunStore
    from runner.sim.tools import NullSandbox

    eng, fk = make(monkeypatch, config={"replies": replies})
    tasks = [Task(f"t{i}", [{"role": "user", "content": "go"}], tools=["submit"]) for i in
             range(n_tasks)]  # fmt: skip
    store = RunStore(tmp_path / "run")
    config = BatchConfig(control_period=0.01, sampling=SP, git_base=False)
    batch = Batch(tasks, eng, NullSandbox(), NoGate(), store, config)
    ids = [t.id for t in tasks]
    execute(batch, eng, "test double", task_ids=ids, invalid_records=0, config={})
    return json.loads((tmp_path / "run" / "summary.json").read_text()), fk


SUBMIT = Reply('<tool_call>{"name": "submit", "arguments": {"answer": "x"}}')


def test_a_batch_retries_transient_aborts_and_counts_them(monkeypatch, tmp_path):
    # both agents' first requests are aborted (waiting queue; retracted under memory
    # pressure, 503), their retries get the submit
    replies = [Abort(), Abort(RETRACTED, status_code=503), SUBMIT, SUBMIT]
    summary, fk = _sglang_batch(monkeypatch, tmp_path, replies, 2)
    assert summary["agents_by_status"] == {"submitted": 2}
    assert summary["engine_retries"] == 2 and len(fk.calls) == 4


def test_a_batch_fails_permanent_refusals_at_once(monkeypatch, tmp_path):
    replies = [Abort("invalid stop_regex '('", status_code=400), Abort(TOO_LONG, status_code=400)]
    summary, fk = _sglang_batch(monkeypatch, tmp_path, replies, 2)
    assert summary["agents_by_status"] == {"error": 1, "context_limit": 1}
    assert summary["engine_retries"] == 0 and len(fk.calls) == 2  # never sent again


async def test_context_limit(monkeypatch):
    eng, fk = make(monkeypatch, config={"context_len": 100})
    with pytest.raises(ContextLimitExceeded):
        await eng.generate(list(range(200, 300)), SP)  # prompt alone fills the context
    assert fk.calls == []  # checked before sending
    g = await eng.generate(list(range(200, 290)), SP)  # max_new clamped to the room left
    assert fk.calls[-1]["sampling_params"]["max_new_tokens"] == 10
    assert g.prompt_tokens == 90
    with pytest.raises(ContextLimitExceeded):  # at tokenizer_manager.max_req_input_len
        await eng.generate(list(range(200, 299)), SP)


async def test_sglang_context_refusal_maps_to_context_limit(monkeypatch):
    eng, _ = make(
        monkeypatch,
        config={
            "replies": [
                ValueError(
                    "The input (9000 tokens) is longer than the model's "
                    "context length (8192 tokens)."
                )
            ]
        },
    )
    with pytest.raises(ContextLimitExceeded):
        await eng.generate([200, 201], SP)


async def test_empty_prompt_and_closed_engine(monkeypatch):
    eng, _ = make(monkeypatch)
    with pytest.raises(EngineError, match="empty"):
        await eng.generate([], SP)
    await eng.aclose()
    with pytest.raises(EngineError, match="shut down"):
        await eng.generate([200], SP)


# ---- the tokenizer ----------------------------------------------------------------------


def test_tokenizer_contract(monkeypatch):
    eng, fk = make(monkeypatch)
    tok = eng.tokenizer
    assert isinstance(tok, SGLangTokenizer)
    ids = tok.encode("<|im_start|>ab")
    assert ids[0] != BOS_ID and ids == [1, 100 + ord("a"), 100 + ord("b")]  # no BOS added
    assert tok.decode([*ids, EOT_ID]) == "ab"  # specials skipped
    assert tok.token_text(EOT_ID) == "<|im_end|>"
    assert tok.eos_ids == {EOS_ID, EOT_ID}  # eos_token_id + template's end of turn
    text = tok.render([{"role": "user", "content": "hi"}], [{"type": "function"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    call = fk.tokenizer_manager.tokenizer.template_calls[-1]
    assert call == {"tools": None, "tokenize": False, "add_generation_prompt": True}
    assert not tok.supports_tools


def test_tokenizer_with_tool_template(monkeypatch):
    eng, fk = make(monkeypatch, config={"tools_in_template": True})
    tok = eng.tokenizer
    assert tok.supports_tools
    schema = [{"type": "function", "function": {"name": "f"}}]
    out = tok.render([{"role": "user", "content": "x"}], schema, add_generation_prompt=False)
    assert out.startswith("# Tools:") and not out.endswith("assistant\n")
    assert fk.tokenizer_manager.tokenizer.template_calls[-1]["tools"] == schema


# ---- the agent loop, token in and token out ---------------------------------------------


class Echo:
    name = "echo"
    description = "Echo the text back."
    parameters = {  # noqa: RUF012
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }

    async def __call__(self, args: dict, ctx: ToolContext) -> Observation:
        return Observation(f"echo: {args['text']}")


async def test_agent_loop_token_in_token_out(monkeypatch, tmp_path: Path):
    replies = [
        Reply('I will echo. <tool_call>{"name": "echo", "arguments": {"text": "hi"}}'),
        Reply('<tool_call>{"name": "submit", "arguments": {"answer": "done"}}'),
    ]
    eng, fk = make(monkeypatch, config={"replies": replies})

    async def main():
        agent = Agent(
            key="t1",
            task=Task("t1", [{"role": "user", "content": "Say hi with echo, then submit."}]),
            engine=eng,
            gate=Gate(4),
            tools={"echo": Echo(), "submit": Submit()},
            tool_ctx=ToolContext(tmp_path, 0, sandbox=None),
            sampling=SamplingParams(max_new_tokens=200, stop=("</tool_call>",)),
            max_steps=5,
        )
        return agent, await agent.run()

    agent, (status, _, answer) = await main()
    assert (status, answer) == ("submitted", "done")
    sent = [c["input_ids"] for c in fk.calls]
    assert len(sent) == 2
    out1 = [*eng.tokenizer.encode(replies[0].text), EOT_ID]
    assert sent[1][: len(sent[0]) + len(out1)] == sent[0] + out1  # step 2 extends step 1
    assert BOS_ID not in sent[0]
    # the observation turn follows the EOS the engine returned, which is not written twice
    delta = eng.tokenizer.hf.decode(sent[1][len(sent[0]) + len(out1) :])
    assert delta.startswith("\n<|im_start|>user\n<tool_response>\necho: hi")
    assert [s.cached_tokens for s in agent.steps] == [0, len(sent[0]) + len(out1)]


# ---- signals ----------------------------------------------------------------------------


def test_usage_from_the_snapshot_reader_per_rank(monkeypatch):
    eng, fk = make(monkeypatch, dp_size=2)
    reader = fk.tokenizer_manager.load_snapshot_reader
    reader.snapshots[:] = [
        FakeLoad(dp_rank=0, token_usage=0.25, num_used_tokens=250, max_total_num_tokens=1000),
        FakeLoad(dp_rank=1, token_usage=0.5, num_used_tokens=500, max_total_num_tokens=1000),
    ]
    stats = eng.cache_stats()  # no event loop needed
    assert isinstance(stats, CacheStats)
    assert stats.usage == 0.5  # the most loaded rank
    assert stats.capacity_tokens == 2000 and stats.used_tokens == 750
    assert stats.extra["usage_source"] == "load_snapshot_reader"
    assert stats.extra["rank_usage"] == [0.25, 0.5]
    assert [r["token_usage"] for r in stats.extra["ranks"]] == [0.25, 0.5]
    assert stats.extra["usage_mean"] == 0.375
    assert "physical_note" in stats.extra and stats.extra["physical_usage"] is None
    reader.snapshots[1].token_usage = 0.9
    assert eng.cache_stats().usage == 0.9  # read fresh on every call
    assert fk.tokenizer_manager.get_loads_calls == 0


def test_usage_before_any_snapshot(monkeypatch):
    eng, fk = make(monkeypatch)
    fk.tokenizer_manager.load_snapshot_reader.snapshots.clear()
    stats = eng.cache_stats()
    assert stats.usage is None and stats.extra["usage_note"] == "no load snapshot yet"


async def test_usage_fallback_polls_get_loads_in_the_background(monkeypatch):
    eng, fk = make(monkeypatch, config={"legacy_loads": True}, loads_refresh_s=0.01)
    tm = fk.tokenizer_manager
    assert not hasattr(tm, "load_snapshot_reader")
    tm.snapshots[0].token_usage = 0.3
    assert eng.cache_stats().usage is None  # outside a loop: nothing started, no value

    async def main():
        first = eng.cache_stats()  # starts the poller; no answer yet
        for _ in range(50):
            await asyncio.sleep(0.01)
            if eng.cache_stats().usage is not None:
                break
        got = eng.cache_stats()
        tm.snapshots[0].token_usage = 0.7
        await asyncio.sleep(0.05)
        later = eng.cache_stats()
        await eng.aclose()
        return first, got, later

    first, got, later = await main()
    assert first.usage is None
    assert got.usage == 0.3 and got.extra["usage_source"] == "get_loads"
    assert later.usage == 0.7
    assert tm.get_loads_calls >= 2
    assert eng._loads._poller is None  # cancelled by aclose


async def test_cache_stats_extra_is_json_serialisable(monkeypatch):
    import json

    eng, _ = make(monkeypatch, dp_size=2, sessions=True)
    await eng.generate([200, 201], SP, agent="a")
    json.dumps(eng.cache_stats().extra)


# ---- sessions, DP ranks, priority ---------------------------------------------------------


async def test_sessions_one_stable_id_per_agent_closed_once(monkeypatch):
    eng, fk = make(monkeypatch, sessions=True)
    assert fk.kwargs["enable_session_radix_cache"] is True
    tm = fk.tokenizer_manager

    async def main():
        for _ in range(3):
            await eng.generate([200, 201], SP, agent="a")
            await eng.generate([300, 301], SP, agent="b")
        await eng.end_agent("a")
        await eng.end_agent("a")  # idempotent
        await eng.generate([400], SP)  # no agent: no session
        assert eng.cache_stats().extra["sessions_open"] == 1
        await eng.aclose()  # closes b

    await main()
    sids = [c["session_id"] for c in fk.calls]
    a, b = sids[0], sids[1]
    assert a != b and sids[:6] == [a, b] * 3 and sids[6] is None
    assert a.endswith("-a") and b.endswith("-b")
    assert sorted(tm.closed) == sorted([a, b]) and len(tm.closed) == 2
    assert tm.opened == []  # radix-native sessions open implicitly with the first request


async def test_session_survives_a_new_agent_with_the_same_key(monkeypatch):
    eng, fk = make(monkeypatch, sessions=True)

    async def main():
        await eng.generate([200], SP, agent="a")
        await eng.end_agent("a")
        await eng.generate([200], SP, agent="a")  # reopened implicitly (new generation)
        await eng.end_agent("a")

    await main()
    assert fk.tokenizer_manager.closed == [fk.calls[0]["session_id"]] * 2


async def test_sessions_off_sends_no_session(monkeypatch):
    eng, fk = make(monkeypatch)
    await eng.generate([200], SP, agent="a")
    await eng.end_agent("a")
    assert fk.calls[0]["session_id"] is None and fk.tokenizer_manager.closed == []
    assert "enable_session_radix_cache" not in fk.kwargs


def test_sessions_server_args_follow_the_installed_release(monkeypatch):
    env = sg_versions.UNIFIED_TREE_ENV

    def start(version):
        monkeypatch.setattr(sg_versions, "installed_version", lambda: version)
        monkeypatch.delenv(env, raising=False)
        _, fk = make(monkeypatch, sessions=True)
        return fk.kwargs, os.environ.get(env)

    # a current release (or one not installed as a distribution): the flag alone
    for version in (None, (0, 5, 23), (0, 5, 19)):
        kwargs, value = start(version)
        assert kwargs["enable_session_radix_cache"] is True and value is None
        assert "radix_eviction_policy" not in kwargs
    kwargs, value = start((0, 5, 17))  # the unified radix tree is opt-in there
    assert value == "1" and "radix_eviction_policy" not in kwargs
    kwargs, value = start((0, 5, 16))  # ServerArgs demands priority eviction there
    assert kwargs["radix_eviction_policy"] == "priority" and value is None


def test_sessions_refused_before_start_on_releases_without_them(monkeypatch):
    handle = install_fake_sglang(monkeypatch)
    monkeypatch.setattr(sg_versions, "installed_version", lambda: (0, 5, 9))
    with pytest.raises(EngineError, match=r"sglang >= 0\.5\.15.*0\.5\.9"):
        SGLangEngine("m", sessions=True)
    assert handle.engines == []  # refused before any engine started
    SGLangEngine("m")  # without sessions 0.5.9 is fine


def test_sessions_on_priority_eviction_releases_refuse_another_policy(monkeypatch):
    install_fake_sglang(monkeypatch)
    monkeypatch.setattr(sg_versions, "installed_version", lambda: (0, 5, 16))
    with pytest.raises(ValueError, match=r"radix_eviction_policy='lru'.*needed by an opt-in"):
        SGLangEngine("m", sessions=True, engine_args={"radix_eviction_policy": "lru"})


def test_release_numbers_parse():
    assert sg_versions.parse_version("0.5.15.post1") == (0, 5, 15)
    assert sg_versions.parse_version("0.5.23") == (0, 5, 23)
    assert sg_versions.parse_version("main") is None


def test_sessions_refused_when_async_generate_lacks_session_id(monkeypatch):
    handle = install_fake_sglang(monkeypatch)

    class Old(handle.engine_class):
        async def async_generate(self, prompt=None, sampling_params=None, input_ids=None):
            return {}

    with pytest.raises(EngineError, match="session_id"):
        SGLangEngine("m", sessions=True, engine_factory=Old)


async def test_sticky_dp_ranks_round_robin(monkeypatch):
    eng, fk = make(monkeypatch, dp_size=3)

    async def main():
        for _ in range(2):
            for key in ("a", "b", "c", "d"):
                await eng.generate([200], SP, agent=key)
        return {k: eng.rank_of(k) for k in "abcd"}

    ranks = await main()
    assert ranks == {"a": 0, "b": 1, "c": 2, "d": 0}
    assert [c["routed_dp_rank"] for c in fk.calls] == [0, 1, 2, 0] * 2  # kept for life
    stats = eng.cache_stats()
    assert stats.extra["agents_per_rank"] == [2, 1, 1]
    assert stats.extra["dp_rank_mismatch"] == 0
    await eng.end_agent("a")
    assert eng.rank_of("a") is None and eng.cache_stats().extra["agents_per_rank"] == [1, 1, 1]


async def test_sticky_dp_ranks_least_loaded(monkeypatch):
    eng, fk = make(monkeypatch, dp_size=2, dp_assign="least_loaded")
    snaps = fk.tokenizer_manager.load_snapshot_reader.snapshots
    snaps[0].token_usage, snaps[1].token_usage = 0.6, 0.1

    async def main():
        await eng.generate([200], SP, agent="a")  # equal agents: lower usage wins -> 1
        await eng.generate([200], SP, agent="b")  # rank 1 has an agent -> 0
        await eng.end_agent("a")
        await eng.generate([200], SP, agent="c")  # rank 1 free again -> 1
        await eng.generate([200], SP, agent="b")

    await main()
    assert [c["routed_dp_rank"] for c in fk.calls] == [1, 0, 1, 0]


async def test_assign_rank_before_the_first_request(monkeypatch):
    eng, fk = make(monkeypatch, dp_size=2)
    assert eng.assign_rank("a") == 0 and eng.assign_rank("b") == 1
    assert eng.assign_rank("a") == 0  # sticky
    await eng.generate([200], SP, agent="b")
    assert fk.calls[0]["routed_dp_rank"] == 1


async def test_no_dp_no_rank(monkeypatch):
    eng, fk = make(monkeypatch)
    await eng.generate([200], SP, agent="a")
    assert fk.calls[0]["routed_dp_rank"] is None and eng.rank_of("a") is None


async def test_dp_rank_uses_the_old_keyword_on_old_releases(monkeypatch):
    handle = install_fake_sglang(monkeypatch)

    class Old(handle.engine_class):
        async def async_generate(
            self, prompt=None, sampling_params=None, input_ids=None, data_parallel_rank=None
        ):
            return await super().async_generate(
                sampling_params=sampling_params,
                input_ids=input_ids,
                data_parallel_rank=data_parallel_rank,
            )

    eng = SGLangEngine("m", dp_size=2, engine_factory=Old)
    await eng.generate([200], SP, agent="a")
    await eng.generate([200], SP, agent="b")
    assert [c["data_parallel_rank"] for c in eng._engine.calls] == [0, 1]


async def test_priority_opt_in(monkeypatch):
    eng, fk = make(monkeypatch, priority="fifo")
    assert fk.kwargs["enable_priority_scheduling"] is True

    async def main():
        for key in ("a", "b", "a", "c"):
            await eng.generate([200], SP, agent=key)
        await eng.generate([200], SP)

    await main()
    # larger value = higher priority (schedule_low_priority_values_first=False)
    assert [c["priority"] for c in fk.calls] == [0, -1, 0, -2, None]

    eng2, fk2 = make(monkeypatch, priority=7)
    await eng2.generate([200], SP, agent="x")
    assert fk2.calls[0]["priority"] == 7

    eng3, fk3 = make(monkeypatch, priority=lambda key: len(key))
    await eng3.generate([200], SP, agent="xyz")
    assert fk3.calls[0]["priority"] == 3


async def test_priority_fifo_low_values_first(monkeypatch):
    eng, fk = make(
        monkeypatch, priority="fifo", engine_args={"schedule_low_priority_values_first": True}
    )
    await eng.generate([200], SP, agent="a")
    await eng.generate([200], SP, agent="b")
    assert [c["priority"] for c in fk.calls] == [0, 1]


def test_priority_must_be_int_fifo_or_callable(monkeypatch):
    for bad in (True, "high"):
        with pytest.raises(ValueError, match="priority"):
            make(monkeypatch, priority=bad)


async def test_priority_off_by_default(monkeypatch):
    eng, fk = make(monkeypatch)
    await eng.generate([200], SP, agent="a")
    assert fk.calls[0]["priority"] is None
    assert "enable_priority_scheduling" not in fk.kwargs


# ---- shutdown -----------------------------------------------------------------------------


async def test_shutdown_order_and_idempotence(monkeypatch):
    eng, fk = make(monkeypatch, sessions=True)

    async def main():
        await eng.generate([200], SP, agent="a")
        await eng.generate([200], SP, agent="b")
        await eng.aclose()
        await eng.aclose()
        await eng.end_agent("a")  # after shutdown: nothing sent

    await main()
    tail = fk.events[-3:]
    assert {e[0] for e in tail[:2]} == {"close_session"} and tail[2] == ("shutdown",)
    assert fk.shutdown_calls == 1
    assert eng.cache_stats().extra["sessions_closed"] == 2


async def test_session_close_failure_does_not_stop_shutdown(monkeypatch):
    eng, fk = make(monkeypatch, sessions=True)

    async def broken(obj, request=None):
        raise RuntimeError("zmq gone")

    fk.tokenizer_manager.close_session = broken

    async def main():
        await eng.generate([200], SP, agent="a")
        await eng.end_agent("a")  # logged, not raised
        await eng.generate([200], SP, agent="b")
        await eng.aclose()

    await main()
    assert fk.shutdown_calls == 1
    assert eng.cache_stats().extra["session_close_errors"] == 2


async def test_sync_helpers_are_never_called(monkeypatch):
    eng, fk = make(
        monkeypatch, sessions=True, dp_size=2, priority="fifo", config={"legacy_loads": True}
    )

    async def main():
        for key in ("a", "b"):
            await eng.generate([200, 201], SP, agent=key)
            eng.cache_stats()
        await eng.end_agent("a")
        await eng.aclose()

    await main()
    assert fk.sync_calls == []
    assert fk.tokenizer_manager.get_loads_calls >= 1


async def test_sync_helpers_of_the_double_do_raise_inside_a_loop(monkeypatch):
    _, fk = make(monkeypatch)
    with pytest.raises(RuntimeError, match="already running"):
        fk.get_server_info()
    await asyncio.to_thread(fk.flush_cache)  # fine outside a loop (a thread has none)
    assert fk.sync_calls == ["get_server_info", "flush_cache"]


# ---- the auto helper --------------------------------------------------------------------


def test_sglang_available(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    ok, why = sglang_available()
    assert not ok and "not installed" in why and "pip install" in why

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert sglang_available() == (True, "sglang is installed and torch sees a CUDA GPU")

    torch.cuda = types.SimpleNamespace(is_available=lambda: False)
    ok, why = sglang_available()
    assert not ok and "no CUDA GPU" in why

    monkeypatch.setitem(sys.modules, "torch", None)  # torch does not import
    monkeypatch.setattr(sg_args.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    ok, why = sglang_available()
    assert ok and "nvidia-smi" in why
    monkeypatch.setattr(sg_args.shutil, "which", lambda name: None)
    ok, why = sglang_available()
    assert not ok and "no CUDA GPU" in why


# ---- CLI helpers ------------------------------------------------------------------------


def test_cli_helpers(monkeypatch):
    import argparse

    install_fake_sglang(monkeypatch)
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--sampling-arg", action="append", default=[])  # the CLI's engine group
    sg.add_sglang_arguments(p)
    args = p.parse_args(
        [
            "--model",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "--dp-size",
            "2",
            "--engine-arg",
            "enable_hierarchical_cache=true",
            "--sampling-arg",
            "top_k=20",
            "--sglang-sessions",
            "--dp-assign",
            "least_loaded",
        ]
    )
    eng = sg.sglang_engine_from_args(args)
    fk = eng._engine
    assert fk.kwargs["dp_size"] == 2 and fk.kwargs["enable_hierarchical_cache"] is True
    assert fk.kwargs["enable_session_radix_cache"]
    assert eng._sampling_extra == {"top_k": 20} and eng._dp_assign == "least_loaded"
    with pytest.raises(SystemExit):  # the rejected priority experiment's flag is gone
        p.parse_args(["--model", "m", "--sglang-priority", "fifo"])
    with pytest.raises(ValueError, match="needs --model"):
        sg.sglang_engine_from_args(p.parse_args([]))


# ---- bench/sglang_check.py runs its whole path against the double -----------------------


def _bench():
    from bench import sglang_check

    return sglang_check


def test_bench_exits_2_without_sglang(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(bench, "sglang_available", lambda: (False, "sglang is not installed"))
    assert bench.main(["--model", "m"]) == 2
    assert "not run: sglang is not installed" in capsys.readouterr().err


def test_bench_against_the_double(monkeypatch, tmp_path):
    import json

    bench = _bench()
    # the double does not decode under a grammar: the 4 constrained replies are scripted
    call = Reply('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
    install_fake_sglang(monkeypatch, replies=[Reply("ok")] * 9 + [call] * 4)
    monkeypatch.setattr(bench, "sglang_available", lambda: (True, "test double"))
    out = tmp_path / "r.json"
    argv = ["--model", "m", "--agents", "3", "--steps", "3", "--obs-chars", "60"]
    rc = bench.main([*argv, "--dp-size", "2", "--sessions", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report["checks"]
    assert report["requests"] == 9 and report["H"]["reuse_steps_2plus_min"] == 1.0
    assert report["engine_extra"]["sessions_closed"] == 3
    assert report["finish"]["stopped_on_eos"] == 9
    assert [c["call"] for c in report["constrained_calls"]] == ["bash"] * 4


def test_bench_keeps_its_report_when_a_constrained_request_fails(monkeypatch, tmp_path):
    import json

    bench = _bench()
    replies = [Reply("ok")] * 2 + [RuntimeError("grammar backend is none")]
    install_fake_sglang(monkeypatch, replies=replies)
    monkeypatch.setattr(bench, "sglang_available", lambda: (True, "test double"))
    out = tmp_path / "r.json"
    argv = ["--model", "m", "--agents", "1", "--steps", "2", "--constrained", "1"]
    assert bench.main([*argv, "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["requests"] == 2  # the measurements before it are kept
    assert report["constrained_calls"][0]["finish"] == "error"
    assert "grammar backend is none" in report["constrained_calls"][0]["call"]


def test_bench_fails_when_a_constrained_reply_is_not_a_call(monkeypatch, tmp_path):
    import json

    bench = _bench()
    install_fake_sglang(monkeypatch, replies=[Reply("ok")] * 2 + [Reply("no call here")])
    monkeypatch.setattr(bench, "sglang_available", lambda: (True, "test double"))
    out = tmp_path / "r.json"
    argv = ["--model", "m", "--agents", "1", "--steps", "2", "--constrained", "1"]
    assert bench.main([*argv, "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["checks"]["constrained_replies_are_one_valid_call"] is False
    assert report["constrained_calls"][0]["text"] == "no call here"


async def test_batch_with_dp_keeps_one_window_per_rank_and_sticky_ranks(monkeypatch, tmp_path):
    """The whole batch over the SGLang double with --dp 2: the per-rank gates bind each
    agent's rank in the adapter before its first request, and every request goes there."""
    from runner.batch.batch import Batch, BatchConfig
    from runner.policies.baselines import AgentCap
    from runner.runfolder.store import RunStore
    from runner.sim.tools import NullSandbox

    submit = Reply('<tool_call>{"name": "submit", "arguments": {"answer": "x"}}')
    eng, fk = make(monkeypatch, config={"replies": [submit] * 6}, dp_size=2)
    tasks = [
        Task(f"t{i}", [{"role": "user", "content": "submit"}], tools=["submit"]) for i in range(6)
    ]
    store = RunStore(tmp_path / "run")
    batch = Batch(
        tasks,
        eng,
        NullSandbox(),
        AgentCap(1),
        store,
        BatchConfig(control_period=0.01, sampling=SP, git_base=False),
    )

    async def main():
        await batch.run()
        await eng.aclose()

    await main()
    assert {r["status"] for r in store.finished.values()} == {"submitted"}
    sent_ranks = {c.get("routed_dp_rank") for c in fk.calls}
    assert sent_ranks == {0, 1}  # both ranks used, one window of 1 each
    s = batch.controller.summary()
    assert s["dp_ranks"] == 2 and s["window"]["max"] == 2
    lines = (tmp_path / "run" / "control.jsonl").read_text().splitlines()
    assert {json.loads(x)["rank"] for x in lines} == {0, 1}


# ---- sampling options checked at start-up, through the command line ----------------------


def _cli(monkeypatch, tmp_path, records, *flags):
    """run.py in process with the SGLang double: -> (exit code, the double, run folder)."""
    from runner.cli.main import main

    handle = install_fake_sglang(monkeypatch)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    argv = ["--tasks", str(path), "--out", str(out), "--engine", "sglang", "--model", "m"]
    code = main([*argv, "--sandbox", "none", "--policy", "none", *flags])
    return code, handle.engine, out


def test_a_bad_sampling_option_stops_the_run_before_any_agent(monkeypatch, tmp_path, capsys):
    tasks = [{"id": "a", "prompt": "p"}]
    code, fk, out = _cli(monkeypatch, tmp_path, tasks, "--sampling-arg", "topk=20")
    err = capsys.readouterr().err
    assert code == 2
    assert "error: sampling options: --sampling-arg topk: not a sampling parameter" in err
    assert "did you mean top_k?" in err
    assert fk.calls == [] and fk.shutdown_calls == 1  # no request; the engine is closed
    assert not out.exists()  # a refused start leaves no run folder it made


def test_a_tasks_sampling_the_engine_refuses_is_named_at_start(monkeypatch, tmp_path, capsys):
    records = [
        {"id": "a", "prompt": "p"},
        {"id": "b", "prompt": "p", "sampling": {"max_new_tokens": 8}},
    ]
    code, fk, _ = _cli(monkeypatch, tmp_path, records, "--sampling-arg", "min_new_tokens=16")
    err = capsys.readouterr().err
    assert code == 2 and fk.calls == []
    assert "task b (its sampling {'max_new_tokens': 8}): SGLang refuses" in err
    assert "min_new_tokens must be in [0, max_new_tokens(8)], got 16" in err


def test_a_ray_worker_checks_the_tasks_sampling_before_any_agent(monkeypatch, tmp_path):
    # --ray: each worker builds its engine on its node (the spec's make_engine, the call the
    # worker makes) and checks the tasks' own overrides there, as one process does at start
    from runner.cli.main import check_options, config_args, dataset_plan, policy_from_args
    from runner.cli.parser import build_parser
    from runner.cli.scaleout import spec_maker

    install_fake_sglang(monkeypatch)
    records = [
        {"id": "a", "prompt": "p"},
        {"id": "b", "prompt": "p", "sampling": {"max_new_tokens": 8}},
        {"id": "c", "prompt": "p", "sampling": {"max_new_tokens": 8}},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["--tasks", str(path), "--out", str(tmp_path / "out"), "--engine", "sglang"]
    args = config_args(build_parser(), [*argv, "--model", "m", "--ray", "--sandbox", "none"])
    check_options(args)
    plan = dataset_plan(args)
    spec = spec_maker(args, plan.tasks, plan.config, policy_from_args(args))(0)
    assert [(t.id, t.sampling) for t in spec.make_engine.args[2]] == [("b", {"max_new_tokens": 8})]
    asyncio.run(spec.make_engine().engine.aclose())  # overrides it can serve: it starts
    args.sampling_arg = ["min_new_tokens=16"]
    plan = dataset_plan(args)
    spec = spec_maker(args, plan.tasks, plan.config, policy_from_args(args))(0)
    with pytest.raises(ValueError, match=r"task b \(its sampling .*\): SGLang refuses"):
        spec.make_engine()


def test_good_sampling_options_reach_every_request(monkeypatch, tmp_path):
    tasks = [{"id": "a", "prompt": "p", "max_steps": 1}]
    code, fk, _ = _cli(monkeypatch, tmp_path, tasks, "--sampling-arg", "top_k=20")
    assert code == 0 and fk.calls and all(c["sampling_params"]["top_k"] == 20 for c in fk.calls)


@pytest.mark.parametrize("engine", ["replay", "sim"])
def test_sampling_args_for_an_engine_that_samples_nothing_are_refused(engine, capsys):
    from runner.cli.main import main

    assert main(["--engine", engine, "--tasks", "x.jsonl", "--sampling-arg", "top_k=2"]) == 2
    assert f"--sampling-arg: --engine {engine} samples nothing" in capsys.readouterr().err
