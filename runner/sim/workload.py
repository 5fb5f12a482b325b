"""Agent workloads for the simulator: seeded synthetic traces, a trace file format, traces
derived from a real run, and the simulated model that replays a trace through the runner.

A trace says, per agent: the opening prompt's size, and per step the tokens the model
generates, the seconds its tool takes and the tokens of the tool's observation. The REAL agent
loop runs it: the simulated model answers each request with the step's tool call (padded to
the step's generated tokens), the `sim_tool` sleeps for the tool's seconds on the virtual
clock and returns an observation of the step's size. All agents share one system prompt.

Trace file (JSONL): a header line {"format": "concur-trace", "version": 1,
"system_tokens": N, "name": ...}, then one line per agent {"id": str, "prompt_tokens": int,
"steps": [[generated_tokens, tool_seconds, observation_tokens], ...]}. The last step's tool
is `submit` (its seconds and observation are ignored).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.core import schema

from ..agent.agent import observation_ids, opening_ids, opening_messages
from ..chat.toolcall import format_call
from ..engines.chatml_tokenizer import EOS_ID, ChatMLTokenizer, span, span_ids
from ..tasks.tasks import Task
from .tools import SIM_TOOLS

SYSTEM_SEED = 0
TRACE_FORMAT = "concur-trace"


@dataclass(frozen=True)
class Step:
    gen_tokens: int
    tool_seconds: float
    obs_tokens: int


@dataclass
class AgentTrace:
    id: str
    prompt_tokens: int
    steps: list[Step]

    def total_tokens(self) -> int:
        return (
            self.prompt_tokens
            + sum(s.gen_tokens + s.obs_tokens for s in self.steps[:-1])
            + (self.steps[-1].gen_tokens if self.steps else 0)
        )


@dataclass
class Workload:
    name: str
    system_tokens: int
    agents: list[AgentTrace]
    params: dict[str, Any] = field(default_factory=dict)

    # ---- file format -----------------------------------------------------------------

    def save(self, path: Path) -> None:
        with path.open("w") as f:
            header = {
                "format": TRACE_FORMAT,
                "version": 1,
                "name": self.name,
                "system_tokens": self.system_tokens,
                "params": self.params,
            }
            f.write(json.dumps(header) + "\n")
            for a in self.agents:
                steps = [[s.gen_tokens, round(s.tool_seconds, 4), s.obs_tokens] for s in a.steps]
                f.write(
                    json.dumps({"id": a.id, "prompt_tokens": a.prompt_tokens, "steps": steps})
                    + "\n"
                )

    @classmethod
    def load(cls, path: Path) -> Workload:
        lines = path.read_text().splitlines()
        if not lines:
            raise ValueError(f"{path}: empty trace file")
        head = json.loads(lines[0])
        if head.get("format") != TRACE_FORMAT:
            raise ValueError(f'{path}:1: not a trace file (needs "format": "{TRACE_FORMAT}")')
        agents = []
        for n, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                steps = [Step(int(g), float(t), int(o)) for g, t, o in rec["steps"]]
                if not steps or any(
                    s.gen_tokens < 1 or s.obs_tokens < 0 or s.tool_seconds < 0 for s in steps
                ):
                    raise ValueError("steps must be non-empty with positive sizes")
                agents.append(AgentTrace(str(rec["id"]), int(rec["prompt_tokens"]), steps))
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{n}: bad agent record: {e}") from None
        return cls(
            head.get("name", path.stem),
            int(head.get("system_tokens", 0)),
            agents,
            head.get("params", {}),
        )

    @classmethod
    def from_trajectories(cls, path: Path, system_tokens: int | None = None) -> Workload:
        """A trace from a real run's trajectories.jsonl: per step, the completion tokens, the
        tool seconds, and the observation size (the next prompt minus this prompt and
        this reply). The shared system prompt, unless given, is estimated as the smallest
        first prompt's cached tokens among agents that had any (the part others had cached)."""
        agents, shared = [], []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            log = rec.get("step_log") or []
            if not log:
                continue
            steps = []
            for cur, nxt in zip(log, [*log[1:], None], strict=True):
                obs = (
                    nxt["prompt_tokens"] - cur["prompt_tokens"] - cur["completion_tokens"]
                    if nxt
                    else 0
                )
                steps.append(
                    Step(max(1, cur["completion_tokens"]), cur["tool_seconds"], max(0, obs))
                )
            if log[0]["cached_tokens"]:
                shared.append(log[0]["cached_tokens"])
            agents.append(AgentTrace(rec["task_id"], log[0]["prompt_tokens"], steps))
        sys_tokens = system_tokens if system_tokens is not None else min(shared, default=0)
        for a in agents:
            a.prompt_tokens = max(1, a.prompt_tokens - sys_tokens)
        return cls(f"replay-{path.parent.name}", sys_tokens, agents, {"source": str(path)})

    # ---- what the runner needs --------------------------------------------------------

    def tasks(self) -> list[Task]:
        system = span(self.system_tokens, SYSTEM_SEED) if self.system_tokens else "."
        return [
            Task(
                id=a.id,
                messages=[
                    {"role": "system", "content": system},
                    {
                        "role": "user",
                        "content": f"{_agent_word(i)} {span(a.prompt_tokens, _seed(i, 0))}",
                    },
                ],
                max_steps=len(a.steps),
                tools=["sim_tool", "submit"],
            )
            for i, a in enumerate(self.agents)
        ]

    def as_sent(self, context_limit: int, pool_tokens: int, max_new: int) -> Workload | None:
        """This trace as the simulated engine receives it through the runner: per agent, its
        opening prompt and every reply and observation turn in the runner's own ids
        (runner.agent.agent's opening_ids and observation_ids, and the simulated model's replies:
        a step whose trace generates fewer tokens than its tool call takes the call's); the
        shared prefix is what every opening prompt begins with (the system prompt and the
        tool instructions). An agent ends where the runner ends it: at a request the engine
        refuses (its prompt plus `max_new` at `context_limit`, or past the pool's longest
        request), or after a reply whose observation would leave no room (the runner's own
        check); its later steps are left out. None if the engine would clip a reply (the
        agent would go on from a reply the trace does not have)."""
        tok = ChatMLTokenizer()
        model, tasks = SimModel(self, tok), self.tasks()
        schemas = [schema(SIM_TOOLS[name]()) for name in tasks[0].tools or ()]
        longest = min(context_limit, pool_tokens) - 1  # SGLang's max_req_len (scheduler.py)
        # an observation turn's ids beyond its span's (a span is one piece of any length)
        turn = len(observation_ids(tok, span(0, 1), tok.token_text(EOS_ID)))
        sent: list[tuple[list[int], list[Step]]] = []
        for i, (a, task) in enumerate(zip(self.agents, tasks, strict=True)):
            opening = opening_ids(tok, opening_messages(task), schemas)
            n, steps = len(opening), []  # n: the agent's context so far
            for k, s in enumerate(a.steps):
                if n + max_new >= context_limit or n > longest - 5:
                    break  # the engine refuses the request: the agent ends (context_limit)
                out = len(model.reply(i, k))
                if out > longest - n - 1:
                    return None  # the engine clips max_new below the reply: cut short
                obs = turn + s.obs_tokens if k < len(a.steps) - 1 else 0
                if obs and n + out + obs + 16 >= context_limit:
                    steps.append(Step(out, s.tool_seconds, 0))
                    break  # the runner ends the agent before sending the observation
                n += out + obs
                steps.append(Step(out, s.tool_seconds, obs))
            sent.append((opening, steps))
        shared = _common_prefix([opening for opening, _ in sent])
        agents = [
            AgentTrace(a.id, len(opening) - shared, steps)
            for a, (opening, steps) in zip(self.agents, sent, strict=True)
        ]
        return Workload(f"{self.name} (as sent)", shared, agents, self.params)


def _common_prefix(seqs: list[list[int]]) -> int:
    """How many leading ids all of `seqs` share (less one where that is all of the
    shortest: an agent's prompt keeps a token of its own)."""
    first, n = seqs[0], min(map(len, seqs))
    for other in seqs[1:]:
        n = next((j for j in range(n) if other[j] != first[j]), n)
    return n - 1 if n and n == min(map(len, seqs)) else n


def _agent_word(i: int) -> str:
    return f"agent-{i}"


def _seed(agent: int, step: int) -> int:
    """Unique span seeds per (agent, step); seed 0 is the shared system prompt."""
    return 1 + agent * 1024 + step


class SimModel:
    """The simulated model: reads which agent and which step a prompt is, and answers with
    that step's tool call, padded with unique 'reasoning' tokens to the step's size."""

    def __init__(self, workload: Workload, tokenizer: ChatMLTokenizer) -> None:
        self.w = workload
        self.tok = tokenizer
        self._agent_of = {
            tokenizer.encode(_agent_word(i))[0]: i for i in range(len(workload.agents))
        }
        self._assistant = tokenizer.encode("assistant")[0]
        self._user = tokenizer.encode("user")[0]
        self._find_from = max(0, workload.system_tokens)

    def __call__(self, prompt: list[int]) -> list[int]:
        try:  # the first user turn opens with the agent's name: <|im_start|> user \n agent-i
            agent = self._agent_of[prompt[prompt.index(self._user, self._find_from) + 2]]
        except (ValueError, KeyError, IndexError):
            raise ValueError("sim model: the prompt names no agent of the workload") from None
        return self.reply(agent, prompt.count(self._assistant) - 1)  # turns before this one

    def reply(self, agent: int, k: int) -> list[int]:
        """The ids agent `agent` generates at step k (0-based; from its last step on, its
        submit): its padding, its tool call, the end of turn."""
        trace = self.w.agents[agent]
        call: dict[str, Any]
        if k >= len(trace.steps) - 1:
            call = {"name": "submit", "arguments": {"answer": "done"}}
            k = len(trace.steps) - 1
        else:
            s = trace.steps[k]
            call = {
                "name": "sim_tool",
                "arguments": {
                    "seconds": s.tool_seconds,
                    "tokens": s.obs_tokens,
                    "seed": observation_seed(agent, k),
                },
            }
        call_ids = self.tok.encode(format_call(call["name"], call["arguments"]))
        pad = trace.steps[k].gen_tokens - len(call_ids) - 1
        filler = span_ids(pad, _seed(agent, k + 1)) if pad > 0 else []
        return [*filler, *call_ids, EOS_ID]


def observation_seed(agent: int, k: int) -> int:
    """The span seed of agent `agent`'s observation after step k (0-based)."""
    return _seed(agent, k + 1) + 512


# ---- seeded synthetic workloads ---------------------------------------------------------

# Calibrated to the paper's description: contexts grow from ~512 to ~32K tokens over 10-50
# steps; multi-second tools; a shared system prompt (docs/simulator.md).
_PAPER: dict[str, Any] = dict(
    agents=256,
    steps=(10, 50),
    start=512,
    final=(16_000, 32_000),
    gen=(40, 200),
    tool_s=(1.0, 8.0),
    system=1_000,
)
# The stress suite (bench/stress.py): workloads the paper's rows do not cover. Options beyond
# the paper's (all drawn from a second seeded stream, so a preset without them is unchanged):
# `long_steps` (p, lo, hi): with probability p an agent takes lo-hi steps instead;
# `final_per_step` (lo, hi): the final context is start + steps x this (replaces `final`);
# `slow_tools` (p, lo, hi): each tool with probability p takes lo-hi s (log-uniform);
# `heavy_tools` (a, lo, cap): every tool time is Pareto with shape a from lo s, cut at cap s
# (replaces `tool_s`; `slow_tools` still applies after it);
# `spikes` (p, lo, hi): each observation with probability p has lo-hi tokens more, unless the
# agent's total would pass `max_context`.
_STRESS: dict[str, dict[str, Any]] = {
    # most tools sub-second, a fifth about a minute
    "stress-slow-tools": {**_PAPER, "tool_s": (0.2, 1.0), "slow_tools": (0.2, 40.0, 80.0)},
    # a few percent of observations 15-25K tokens, on top of smaller contexts
    "stress-spikes": {
        **_PAPER,
        "final": (6_000, 14_000),
        "spikes": (0.05, 15_000, 25_000),
        "max_context": 38_000,
    },
    # an 8K-token common system prompt, short turns
    "stress-shared-prefix": {
        **_PAPER,
        "system": 8_000,
        "start": 256,
        "steps": (10, 30),
        "final": (2_000, 6_000),
        "gen": (20, 80),
    },
    # most agents under 10 steps, some near 90
    "stress-long-tail": {
        **_PAPER,
        "steps": (3, 9),
        "long_steps": (0.08, 80, 95),
        "final_per_step": (250, 400),
    },
    # 2,048 short agents
    "stress-swarm": {
        **_PAPER,
        "agents": 2048,
        "steps": (3, 12),
        "start": 256,
        "final": (1_000, 4_000),
        "gen": (20, 100),
        "tool_s": (0.5, 4.0),
    },
    # the DeepSeek agents with observation spikes
    "stress-deepseek-spikes": {
        **_PAPER,
        "agents": 32,
        "final": (6_000, 14_000),
        "spikes": (0.03, 15_000, 25_000),
        "max_context": 60_000,
    },
}
PRESETS: dict[str, dict[str, Any]] = {
    "paper": _PAPER,
    # the DeepSeek-V3 rows: the same agents, fewer of them
    **{f"paper-deepseek-{n}": {**_PAPER, "agents": n} for n in (16, 32, 40)},
    **_STRESS,
    "tiny": dict(
        agents=8,
        steps=(3, 6),
        start=64,
        final=(300, 600),
        gen=(8, 24),
        tool_s=(0.5, 2.0),
        system=32,
    ),
}


def synthetic(preset: str = "paper", seed: int = 0, **overrides: Any) -> Workload:
    """A seeded workload. Per agent: a step count, a final context size, and per step a
    generated size and a log-uniform tool time; observations fill the context from `start`
    to the final size, unevenly (a few large outputs, many small ones). The stress options
    (above `PRESETS`) change step counts, tools and observations from a second stream."""
    if preset not in PRESETS:
        raise ValueError(f"unknown workload preset {preset!r}; choose from {sorted(PRESETS)}")
    p = {**PRESETS[preset], **overrides}
    rng = random.Random(seed)
    aux = random.Random(f"{seed}:stress")
    agents = []
    for i in range(p["agents"]):
        n = rng.randint(*p["steps"])
        if "long_steps" in p and aux.random() < p["long_steps"][0]:
            n = aux.randint(*p["long_steps"][1:])
        if "final_per_step" in p:
            final = p["start"] + n * rng.randint(*p["final_per_step"])
        else:
            final = rng.randint(*p["final"])
        gens = [rng.randint(*p["gen"]) for _ in range(n)]
        budget = max(0, final - p["start"] - sum(gens[:-1]))
        weights = [rng.expovariate(1.0) for _ in range(n - 1)]
        total_w = sum(weights) or 1.0
        obs = [int(budget * w / total_w) for w in weights]
        lo, hi = p["tool_s"]
        tools = [math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(n - 1)]
        if "heavy_tools" in p:
            a, tlo, cap = p["heavy_tools"]
            tools = [min(cap, tlo * (1.0 - aux.random()) ** (-1.0 / a)) for _ in tools]
        if "slow_tools" in p:
            q, slo, shi = p["slow_tools"]
            tools = [
                math.exp(aux.uniform(math.log(slo), math.log(shi))) if aux.random() < q else t
                for t in tools
            ]
        if "spikes" in p:
            obs = _spiked(obs, aux, p["spikes"], p["max_context"] - final)
        steps = [Step(g, t, o) for g, t, o in zip(gens[:-1], tools, obs, strict=True)]
        steps.append(Step(gens[-1], 0.0, 0))
        agents.append(AgentTrace(f"agent-{i:04d}", p["start"], steps))
    return Workload(preset, p["system"], agents, {"preset": preset, "seed": seed, **p})


def _spiked(
    obs: list[int], rng: random.Random, spec: tuple[float, int, int], room: int
) -> list[int]:
    """Observations with a few spikes added, while they fit `room` more tokens."""
    q, lo, hi = spec
    out = []
    for o in obs:
        if rng.random() < q:
            extra = rng.randint(lo, hi)
            if extra <= room:
                o += extra
                room -= extra
        out.append(o)
    return out
