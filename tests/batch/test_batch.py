"""Batch-level behaviour with a test-double engine (no model, no sandbox)."""

import asyncio
import json

import pytest

from runner.batch.batch import ENGINE_FAILURE_LIMIT, Batch, BatchConfig, EngineDead
from runner.engines.chatml_tokenizer import ChatMLTokenizer
from runner.engines.protocol import CacheStats, EngineError
from runner.policies.baselines import NoGate
from runner.runfolder.store import RunStore
from runner.sim.tools import NullSandbox
from runner.tasks.tasks import Task


class DeadEngine:
    """Test double of an engine whose every request fails, as a crashed server's would."""

    name, model, context_limit = "dead", "none", 4096

    def __init__(self):
        self.tokenizer = ChatMLTokenizer()
        self.calls = 0

    async def generate(self, ids, sampling, *, agent=None):
        self.calls += 1
        await asyncio.sleep(0)
        raise EngineError("connection to the engine lost")

    async def end_agent(self, agent):
        return None

    def cache_stats(self):
        return CacheStats(None)

    async def aclose(self):
        return None


async def test_a_dead_engine_stops_the_batch_instead_of_failing_every_task(tmp_path):
    tasks = [
        Task(f"t{i}", [{"role": "user", "content": "hi"}], tools=["submit"]) for i in range(40)
    ]
    store = RunStore(tmp_path / "run")
    engine = DeadEngine()
    batch = Batch(
        tasks,
        engine,
        NullSandbox(),
        NoGate(),
        store,
        BatchConfig(control_period=0.05, git_base=False),
    )
    with pytest.raises(EngineDead, match=f"{ENGINE_FAILURE_LIMIT} agents in a row"):
        await batch.run()
    # the first failures are recorded (one failing request is an agent's error), the rest of
    # the batch is left unfinished for a later run, not turned into 40 error records
    errors = [r for r in store.finished.values() if r["status"] == "error"]
    assert len(errors) == ENGINE_FAILURE_LIMIT - 1
    assert all("connection to the engine lost" in r["reason"] for r in errors)
    # on the next run they are retried by default
    assert len(store.retry_errors({t.id for t in tasks})) == ENGINE_FAILURE_LIMIT - 1


def test_per_task_sampling_overrides_the_run():
    from runner.batch.batch import sampling_for
    from runner.engines.protocol import SamplingParams
    from runner.tasks.tasks import validate

    base = SamplingParams(temperature=0.6, max_new_tokens=256, stop=("</tool_call>",))
    t = validate(
        {
            "id": "a",
            "prompt": "x",
            "sampling": {"temperature": 0, "max_new_tokens": 64.0, "stop": ["END"]},
        }
    )
    sp = sampling_for(base, t)
    assert (sp.temperature, sp.max_new_tokens, sp.top_p) == (0, 64, base.top_p)
    assert sp.stop == ("</tool_call>", "END")  # the tool-call stop string is kept
    assert sampling_for(base, validate({"id": "b", "prompt": "x"})) is base
    with pytest.raises(ValueError, match="unknown keys"):
        validate({"id": "c", "prompt": "x", "sampling": {"temp": 1}})
    for bad, rule in (
        ({"top_p": -1}, r"in \(0, 1\]"),
        ({"top_p": 0}, r"in \(0, 1\]"),  # SGLang's verify() would refuse every request
        ({"temperature": float("nan")}, ">= 0"),
        ({"max_new_tokens": 0}, "integer >= 1"),
        ({"max_new_tokens": 2.5}, "integer >= 1"),
        ({"seed": True}, "integer >= 0"),
        ({"stop": [""]}, "non-empty strings"),
    ):
        with pytest.raises(ValueError, match=f"bad value .*: .*{rule}"):
            validate({"id": "c", "prompt": "x", "sampling": bad})


async def test_an_agent_error_is_logged_even_when_recording_it_in_full_fails(tmp_path):
    tasks = [Task("t0", [{"role": "user", "content": "hi"}], tools=["submit"])]
    store = RunStore(tmp_path / "run")
    batch = Batch(
        tasks,
        DeadEngine(),
        NullSandbox(),
        NoGate(),
        store,
        BatchConfig(control_period=0.05, git_base=False),
    )

    async def broken_eval(task, ctx):
        raise RuntimeError("eval machinery broke")

    batch._evaluate = broken_eval  # type: ignore[method-assign]
    await batch.run()
    (record,) = store.finished.values()
    assert record["reason"].startswith("recording failed: RuntimeError: eval machinery broke")
    errors = [json.loads(line) for line in (tmp_path / "run" / "errors.jsonl").open()]
    assert [(e["task_id"], e["kind"]) for e in errors] == [("t0", "agent")]
    assert "connection to the engine lost" in errors[0]["reason"]  # the agent's own reason
