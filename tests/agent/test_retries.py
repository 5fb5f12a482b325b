"""Engine retries (runner/agent/retries.py): transient failures retried with backoff and counted in
summary.json, permanent ones fail at once, attempts and total time bounded. Test doubles of
the engine interface (named as such), the real batch and session around them."""

from __future__ import annotations

import asyncio
import json

import pytest

from runner.agent.retries import RetryPolicy, generate, is_transient
from runner.batch.batch import Batch, BatchConfig
from runner.batch.session import execute
from runner.chat.toolcall import format_call
from runner.engines.chatml_tokenizer import ChatMLTokenizer
from runner.engines.protocol import (
    CacheStats,
    ContextLimitExceeded,
    EngineError,
    Generation,
    SamplingParams,
    TransientEngineError,
)
from runner.policies.baselines import NoGate
from runner.runfolder.store import RunStore
from runner.sim.tools import NullSandbox
from runner.tasks.tasks import Task

FAST = RetryPolicy(attempts=4, max_seconds=30, initial_wait=0.01, max_wait=0.02)


class FlakyEngineDouble:
    """Test double of an engine: each agent's first `fail` requests raise `error`, then it
    replies with a submit call."""

    name, model, context_limit = "flaky-double", "none", 100_000

    def __init__(self, fail: int, error: Exception) -> None:
        self.tokenizer = ChatMLTokenizer()
        self.fail, self.error = fail, error
        self.calls: dict[str, int] = {}

    async def generate(self, ids, sampling, *, agent=None):
        n = self.calls[agent] = self.calls.get(agent, 0) + 1
        await asyncio.sleep(0)
        if n <= self.fail:
            raise self.error
        out = self.tokenizer.encode(format_call("submit", {"answer": "ok"}))
        return Generation(out, self.tokenizer.decode(out), len(ids), 0, len(out), "stop", 0.0)

    async def end_agent(self, agent):
        return None

    def cache_stats(self):
        return CacheStats(None)

    async def aclose(self):
        return None


def test_classification():
    assert is_transient(TransientEngineError("aborted")) and is_transient(TimeoutError())
    assert is_transient(ConnectionResetError())
    assert not is_transient(ContextLimitExceeded("too long"))
    assert not is_transient(EngineError("invalid argument")) and not is_transient(ValueError())


@pytest.mark.asyncio
async def test_transient_failures_are_retried_then_succeed():
    engine = FlakyEngineDouble(2, TransientEngineError("request aborted (out of memory)"))
    seen = []
    gen = await generate(engine, [1, 2], SamplingParams(), "a", FAST, lambda: seen.append(1))
    assert gen.finish_reason == "stop" and engine.calls["a"] == 3 and len(seen) == 2


@pytest.mark.asyncio
async def test_permanent_failures_fail_at_once():
    engine = FlakyEngineDouble(1, ContextLimitExceeded("prompt longer than the context"))
    with pytest.raises(ContextLimitExceeded):
        await generate(engine, [1], SamplingParams(), "a", FAST)
    assert engine.calls["a"] == 1


@pytest.mark.asyncio
async def test_attempts_are_bounded():
    engine = FlakyEngineDouble(100, TimeoutError("engine timed out"))
    with pytest.raises(TimeoutError):
        await generate(engine, [1], SamplingParams(), "a", FAST)
    assert engine.calls["a"] == FAST.attempts


@pytest.mark.asyncio
async def test_total_time_is_bounded():
    slow = RetryPolicy(attempts=100, max_seconds=0.2, initial_wait=0.05, max_wait=0.05)
    engine = FlakyEngineDouble(1000, TransientEngineError("retracted"))
    with pytest.raises(TransientEngineError):
        await generate(engine, [1], SamplingParams(), "a", slow)
    assert 2 <= engine.calls["a"] < 10


def test_a_batch_counts_its_retries_in_the_summary(tmp_path, caplog):
    tasks = [Task(f"t{i}", [{"role": "user", "content": "hi"}], tools=["submit"]) for i in range(3)]
    store = RunStore(tmp_path / "run")
    engine = FlakyEngineDouble(1, TransientEngineError("connection reset"))
    batch = Batch(tasks, engine, NullSandbox(), NoGate(), store, BatchConfig(git_base=False))
    out = execute(
        batch, engine, "test double", task_ids=[t.id for t in tasks], invalid_records=0, config={}
    )
    assert out.exit_code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine_retries"] == 3 and summary["agents_by_status"] == {"submitted": 3}
    assert caplog.text.count("engine request failed (TransientEngineError") == 3
