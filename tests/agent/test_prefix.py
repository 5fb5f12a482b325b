"""Token in, token out with the real SmolLM2 tokenizer and engine."""

import shutil
import tempfile
from pathlib import Path

import pytest

from runner.agent.agent import Agent
from runner.engines.llama_cpp import LlamaCppEngine
from runner.engines.protocol import SamplingParams
from runner.gate.gate import Gate
from runner.tasks.tasks import Task
from tools.core import ToolContext
from tools.registry import get_tools
from tools.sandbox import AGENT_UID_BASE, make_sandbox

pytestmark = pytest.mark.slow


class RecordingEngine:
    """Test wrapper around the real engine: records the ids sent and the ids returned."""

    def __init__(self, inner):
        self.inner = inner
        self.sent: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.name, self.model, self.context_limit = inner.name, inner.model, inner.context_limit
        self.tokenizer = inner.tokenizer

    async def generate(self, ids, sampling, agent=None):
        self.sent.append(list(ids))
        g = await self.inner.generate(ids, sampling, agent=agent)
        self.outputs.append(list(g.output_ids))
        return g

    def cache_stats(self):
        return self.inner.cache_stats()


async def test_ids_for_step_k_plus_1_extend_step_k(needs_bwrap):
    root = Path(tempfile.mkdtemp(prefix="concur-test-"))
    root.chmod(0o755)  # per-agent uids must traverse it

    async def main():
        inner = LlamaCppEngine(n_ctx=4096, pool_tokens=8192, max_seqs=4)
        eng = RecordingEngine(inner)
        sandbox = make_sandbox("bwrap")
        ws = root / "ws"
        uid = AGENT_UID_BASE + 900
        ws.mkdir()
        sandbox.prepare_workspace(ws, uid)
        task = Task(
            "t1",
            [{"role": "user", "content": "List the files here with the bash tool, then submit."}],
        )
        agent = Agent(
            "t1",
            task,
            eng,
            Gate(1),
            get_tools(("bash", "submit")),
            ToolContext(ws, uid, sandbox),
            SamplingParams(temperature=0.7, max_new_tokens=48, stop=("</tool_call>",), seed=3),
            max_steps=4,
        )
        status, _, _ = await agent.run()
        eng.im_start = eng.tokenizer.encode("<|im_start|>")
        await sandbox.aclose()
        await inner.aclose()
        return eng, agent, status

    try:
        eng, agent, status = await main()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert len(eng.sent) >= 2, status
    for k in range(len(eng.sent) - 1):
        prefix = eng.sent[k] + eng.outputs[k]
        assert eng.sent[k + 1][: len(prefix)] == prefix, (
            f"step {k + 2} does not extend step {k + 1}"
        )
        assert len(eng.sent[k + 1]) > len(prefix)  # the observation turn was appended
    # the delta carries the chat template's turn markers, tokenized as special tokens
    im_start = eng.im_start
    assert len(im_start) == 1
    assert eng.sent[1][len(eng.sent[0]) + len(eng.outputs[0]) :].count(im_start[0]) == 2
    # later requests reuse the cached prefix
    assert all(s.cached_tokens >= len(eng.sent[0]) - 1 for s in agent.steps[1:])
