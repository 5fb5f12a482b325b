"""The agent loop: generate -> parse tool call -> run tool -> append observation -> repeat.

Token in, token out: the chat template is applied once to the opening conversation; after
that the agent's ids only ever grow by the engine's output ids and the tokenized delta of
the next turn, so every request's prompt extends the previous one exactly and the engine's
prefix cache can serve it. Endings are exceptions carrying a status; the loop has no flags.

Two views of one conversation are kept: `messages`, structured (OpenAI form: the raw reply
plus its parsed `tool_calls`, tool results as `tool` turns, the system prompt as the task gave
it), and `ids`, the exact token stream, where a template without a tool role got the tools
described in the system prompt and each result wrapped in a user turn. `spans` and
`logprobs` say which ids the model generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tools.core import Observation, Tool, ToolContext, call_schema, cap, check_args, schema

from ..chat.template import turn_delta
from ..chat.toolcall import STOP, ParseError, ToolCall, parse_tool_call, tools_prompt
from ..engines.protocol import ContextLimitExceeded, Engine, Generation, SamplingParams, Tokenizer
from ..gate.gate import AdmissionGate
from ..runfolder.records import as_message, message, tool_call
from ..tasks.tasks import Task
from . import retries

DEFAULT_SYSTEM = (
    "You are an autonomous software engineering agent working in a sandboxed shell. "
    "Solve the user's task step by step. In every reply, think briefly, then call exactly "
    "one tool. When the task is done, call the submit tool."
)
OBSERVATION_RECORD_CAP = 4000  # characters of each observation kept in the trajectory


def opening_messages(task: Task) -> list[dict[str, Any]]:
    """The conversation an agent opens with: the task's messages, a default system prompt
    first where the task has none."""
    messages = [as_message(m) for m in task.messages]
    if messages[0]["role"] != "system":
        messages.insert(0, message("system", DEFAULT_SYSTEM))
    return messages


def opening_ids(
    tok: Tokenizer, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]
) -> list[int]:
    """The opening prompt's ids: the chat template applied once, with a generation prompt.
    (The simulator's oracle counts the runner's prompts through this too.)"""
    rendered = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not tok.supports_tools:  # e.g. SmolLM2's ChatML: describe the tools ourselves
        rendered[0]["content"] += tools_prompt([s["function"] for s in schemas])
    return tok.encode(tok.render(rendered, schemas, add_generation_prompt=True))


def observation_ids(tok: Tokenizer, text: str, eos_text: str) -> list[int]:
    """The ids appended after a reply for a tool's observation `text` and the next
    generation prompt (`eos_text`: see Agent.observe)."""
    if tok.supports_tools:
        role, content = "tool", text
    else:
        role, content = "user", f"<tool_response>\n{text}\n</tool_response>"
    delta = turn_delta(
        lambda m, g: tok.render(m, None, add_generation_prompt=g), role, content, eos_text
    )
    return tok.encode(delta)


def _now() -> float:
    """Loop time: wall-clock in real runs, virtual time in simulations."""
    return asyncio.get_running_loop().time()


class AgentEnd(Exception):
    status = "error"

    def __init__(self, reason: str = "", answer: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.answer = reason, answer


class Submitted(AgentEnd):
    status = "submitted"


class StepLimit(AgentEnd):
    status = "max_steps"


class ContextLimit(AgentEnd):
    status = "context_limit"


@dataclass
class Step:
    step: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gen_seconds: float = 0.0
    finish_reason: str = ""
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    tool_seconds: float = 0.0
    observation: str = ""
    tool_ok: bool | None = None
    wait_seconds: float = 0.0  # time at the gate before this generation


@dataclass
class Agent:
    key: str
    task: Task
    engine: Engine
    gate: AdmissionGate
    tools: dict[str, Tool]
    tool_ctx: ToolContext
    sampling: SamplingParams
    max_steps: int
    # called after every request: (the engine's Generation, fresh tokens: the part of the
    # prompt never sent to the engine before)
    on_request: Callable[[Generation, int], None] = lambda gen, fresh: None
    steps: list[Step] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    seen: int = 0  # how many of self.ids the engine has already had (as prompt or output)
    constrain_tool_calls: bool = False  # ask the engine for exactly one well-formed call
    prompt_len: int = 0  # len(ids) of the opening prompt
    retry: retries.RetryPolicy = field(default_factory=retries.RetryPolicy)
    on_retry: Callable[[], None] = lambda: None  # called before each retry of a request
    # per step, offsets into ids: (output start, output end = observation start, observation end)
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    # one per generated id while every request returned logprobs; None once one did not
    logprobs: list[float] | None = field(default_factory=list)
    tool_schemas: list[dict[str, Any]] = field(default_factory=list)
    in_tool: bool = False  # a tool call is running (for the progress display)

    async def run(self) -> tuple[str, str, str | None]:
        """Run to the end. -> (status, reason, final answer). Engine failures propagate."""
        self.start()
        try:
            for n in range(1, self.max_steps + 1):
                await self.step(n)
            raise StepLimit(f"reached max_steps={self.max_steps} without submitting")
        except AgentEnd as end:
            return end.status, end.reason, end.answer

    def start(self) -> None:
        tok = self.engine.tokenizer
        schemas = self.tool_schemas = [schema(t) for t in self.tools.values()]
        self.messages = opening_messages(self.task)
        self.ids = opening_ids(tok, self.messages, schemas)
        self.prompt_len = len(self.ids)
        # The loop depends on replies ending where the call closes, whatever the task asked.
        stop = tuple(dict.fromkeys((*self.sampling.stop, STOP)))
        schema_text = json.dumps(call_schema(self.tools)) if self.constrain_tool_calls else None
        self.sampling = dataclasses.replace(self.sampling, stop=stop, tool_call_schema=schema_text)

    async def step(self, n: int) -> None:
        step = Step(n)
        self.steps.append(step)
        t_wait = _now()
        await self.gate.acquire(self.key, len(self.ids))
        step.wait_seconds = _now() - t_wait
        try:
            gen = await retries.generate(
                self.engine, self.ids, self.sampling, self.key, self.retry, self.on_retry
            )
        except ContextLimitExceeded as e:
            raise ContextLimit(str(e)) from None
        finally:
            self.gate.done_request(self.key)
        self.on_request(gen, len(self.ids) - self.seen)
        step.prompt_tokens, step.cached_tokens = gen.prompt_tokens, gen.cached_tokens
        step.completion_tokens, step.gen_seconds = gen.completion_tokens, gen.seconds
        step.finish_reason = gen.finish_reason
        self._append_output(gen)

        call = self.parse(gen.text)
        call_id, calls = None, None
        if isinstance(call, ToolCall):
            call_id = f"call_{n}"
            calls = [tool_call(call_id, call.name, call.arguments)]
        self.messages.append(message("assistant", gen.text, calls))
        obs = await self.act(call, step)
        step.observation = cap(obs.text, OBSERVATION_RECORD_CAP)
        step.tool_ok = obs.ok
        if obs.submitted:
            raise Submitted("the agent called submit", obs.answer)
        tok = self.engine.tokenizer
        eos_text = tok.token_text(gen.output_ids[-1]) if gen.stopped_on_eos else ""
        self.observe(obs.text, eos_text, call_id, step.tool)

    def _append_output(self, gen: Generation) -> None:
        start = len(self.ids)
        self.ids += gen.output_ids
        self.seen = len(self.ids)
        self.spans.append((start, len(self.ids), len(self.ids)))
        lp = gen.output_logprobs
        if self.logprobs is not None and lp is not None and len(lp) == len(gen.output_ids):
            self.logprobs += lp
        else:
            self.logprobs = None

    def parse(self, reply: str) -> ToolCall | ParseError:
        try:
            return parse_tool_call(reply, frozenset(self.tools))
        except ParseError as e:
            return e

    async def act(self, call: ToolCall | ParseError, step: Step) -> Observation:
        """Run the tool the reply calls; every failure becomes an observation."""
        if isinstance(call, ParseError):
            return Observation(str(call), ok=False)
        step.tool, step.arguments = call.name, call.arguments
        tool = self.tools[call.name]
        problem = check_args(tool, call.arguments)
        if problem:
            return Observation(problem, ok=False)
        t0 = _now()
        self.in_tool = True
        try:
            return await tool(call.arguments, self.tool_ctx)
        except Exception as e:  # a tool bug must not kill the agent
            return Observation(f"{call.name} failed: {type(e).__name__}: {e}", ok=False)
        finally:
            self.in_tool = False
            step.tool_seconds = _now() - t0

    def observe(
        self, text: str, eos_text: str, call_id: str | None = None, tool: str | None = None
    ) -> None:
        """Append the observation turn. `eos_text`: the end-of-turn token the reply ended on
        (already in self.ids), or "" if it ended otherwise. `call_id`, `tool`: the call this
        answers (None when the reply held no valid call)."""
        delta_ids = observation_ids(self.engine.tokenizer, text, eos_text)
        # Leave room for at least a short reply; otherwise the next request cannot fit.
        if len(self.ids) + len(delta_ids) + 16 >= self.engine.context_limit:
            raise ContextLimit(
                f"context full: {len(self.ids)} + {len(delta_ids)} observation tokens exceed "
                f"{self.engine.context_limit}"
            )
        self.ids += delta_ids
        start, end, _ = self.spans[-1]
        self.spans[-1] = (start, end, len(self.ids))
        self.messages.append(message("tool", text, tool_call_id=call_id, name=tool))
