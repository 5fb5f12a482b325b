"""How far below the policies a schedule can go: upper estimates of the optimum.

    python -m bench.constructed_schedule  # ~2 min; bench/results/constructed-schedule/

Drives `SimEngine` directly (no runner: no gate, no chat template, so prompts are exactly the
workload's tokens) on Qwen3-32B TP8, the paper workload (seed 0), under clairvoyant schedules
(they know every agent's chain and final context):
- `greedy`: every agent sends its next request as soon as its tool returns;
- `critical K/J`: the K agents with the longest chains never wait; any other agent's next
  request waits while more than J of those K are in flight, so its prefill joins theirs and
  its decode rides with them;
- `packed beta`: agents start in order of their chains, longest first, while the private
  final contexts of the started and unfinished ones fit beta x the pool; once started an
  agent runs greedily to its end (beta 1: nothing is ever evicted).
The first two run with 8x the GPU memory (pool 18M tokens: memory never binds), `packed` on
the real pool. Each figure is a schedule the simulated engine ran, so the optimum is at most
the fastest; the oracle's bound (runner/sim/oracle.py) is at most the optimum. Together they
bracket how much any tighter bound could add (docs/simulator.md, "The oracle lower bound").
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from dataclasses import dataclass, replace
from typing import Any

from bench.common.paths import CONSTRUCTED_RESULTS
from runner.engines.chatml_tokenizer import ChatMLTokenizer
from runner.engines.protocol import SamplingParams
from runner.sim.engine import CostModel, SimEngine, make_sim_engine
from runner.sim.engine import deployment as sim_deployment
from runner.sim.oracle import lower_bound, totals
from runner.sim.vclock import run_virtual
from runner.sim.workload import Workload, synthetic

DEPLOYMENT, WORKLOAD = "qwen3-32b-tp8", "paper"
TOKENS = ChatMLTokenizer()  # the engine only uses its EOS id here
EOS = min(TOKENS.eos_ids)
FIRST_ID = 10**7  # fresh ids from here (none is an EOS id): each agent's tokens its own


@dataclass(frozen=True)
class Schedule:
    kind: str  # "greedy", "critical" or "packed"
    memory_x: int = 1  # GPU memory multiplier
    top: int = 0  # critical: K
    most: int = 0  # critical: J
    beta: float = 1.0  # packed

    @property
    def name(self) -> str:
        if self.kind == "critical":
            return f"critical {self.top}/{self.most}"
        return f"packed {self.beta}" if self.kind == "packed" else self.kind


SCHEDULES = [
    Schedule("greedy", memory_x=8),
    *(Schedule("critical", memory_x=8, top=k, most=j) for k, j in ((20, 10), (40, 20), (60, 30))),
    *(Schedule("packed", beta=b) for b in (1.0, 1.1, 1.2)),
]


@dataclass
class _Run:
    seconds: float
    stats: dict[str, Any]


class _Gate:
    """Who may send a request now, under a schedule."""

    def __init__(self, w: Workload, s: Schedule, chains: list[float], pool: int) -> None:
        self.s, self.cond = s, asyncio.Condition()
        order = sorted(range(len(w.agents)), key=lambda a: -chains[a])
        self.top = set(order[: s.top])
        self.in_flight: set[int] = set()  # critical: top agents with a request in flight
        self.queue = order if s.kind == "packed" else []  # packed: agents not started yet
        self.need = [a.total_tokens() for a in w.agents]  # private final contexts
        self.room, self.held = s.beta * pool, 0

    async def start(self, i: int) -> None:
        if self.s.kind != "packed":
            return
        async with self.cond:
            await self.cond.wait_for(lambda: self.queue[0] == i and self._fits(i))
            self.queue.pop(0)
            self.held += self.need[i]
            self.cond.notify_all()

    def _fits(self, i: int) -> bool:
        return self.held == 0 or self.held + self.need[i] <= self.room

    async def request(self, i: int) -> None:
        if self.s.kind == "critical" and i not in self.top:
            async with self.cond:
                await self.cond.wait_for(lambda: len(self.in_flight) <= self.s.most)
        if i in self.top:
            self.in_flight.add(i)

    async def done(self, i: int, finished: bool) -> None:
        async with self.cond:
            self.in_flight.discard(i)
            if finished and self.s.kind == "packed":
                self.held -= self.need[i]
            self.cond.notify_all()


def _options(s: Schedule) -> dict[str, Any]:
    gpu = sim_deployment(DEPLOYMENT).gpu
    return {"gpu": replace(gpu, memory_bytes=gpu.memory_bytes * s.memory_x)}


def _simulate(w: Workload, s: Schedule) -> _Run:
    opts = _options(s)
    dep = sim_deployment(DEPLOYMENT, **opts)
    gate = _Gate(w, s, totals(w, CostModel(dep)).chains, dep.pool_tokens)
    fresh = itertools.count(FIRST_ID)  # token ids unique to one agent's context
    system = list(range(1, w.system_tokens + 1))
    outputs: list[list[int]] = []  # the next request's output, handed to the model double
    sampling = SamplingParams(max_new_tokens=4096)

    async def agent(i: int, engine: SimEngine) -> None:
        a = w.agents[i]
        await gate.start(i)
        ids = system + [next(fresh) for _ in range(a.prompt_tokens)]
        for k, step in enumerate(a.steps):
            await gate.request(i)
            out = [next(fresh) for _ in range(step.gen_tokens - 1)] + [EOS]
            outputs.append(out)  # read by the model before generate awaits anything
            await engine.generate(list(ids), sampling, agent=str(i))
            await gate.done(i, finished=k == len(a.steps) - 1)
            ids += out
            if k < len(a.steps) - 1:
                await asyncio.sleep(step.tool_seconds)
                ids += [next(fresh) for _ in range(step.obs_tokens)]

    async def run() -> _Run:
        loop = asyncio.get_running_loop()
        engine = make_sim_engine(DEPLOYMENT, TOKENS, lambda _: outputs.pop(), **opts)
        start = loop.time()
        async with asyncio.TaskGroup() as tg:
            for i in range(len(w.agents)):
                tg.create_task(agent(i, engine))
        stats = engine.stats()
        await engine.aclose()
        return _Run(loop.time() - start, stats)

    return run_virtual(run())


def main() -> int:
    w = synthetic(WORKLOAD, seed=0)
    out = ["# Constructed schedules against the lower bound", ""]
    out.append(
        f"Generated by `python -m bench.constructed_schedule`: {DEPLOYMENT}, workload "
        f"`{WORKLOAD}` (seed 0), `SimEngine` driven directly by clairvoyant schedules (the "
        "script's docstring says each); `x8` runs have 8x the GPU memory (the pool never "
        "binds), the others the real pool. Bound: runner/sim/oracle.py for that memory, over "
        "the trace's own tokens (no runner: no template tokens)."
    )
    out += ["", "| schedule | memory | seconds | bound s | / bound | decode iterations "
            "| prefill iterations | prefill s | of it recompute | decode s | idle s "
            "| retractions |", "|---" * 12 + "|"]  # fmt: skip
    for s in SCHEDULES:
        bound = lower_bound(w, DEPLOYMENT, through_runner=False, **_options(s))  # no runner
        r = _simulate(w, s)
        st, b = r.stats, bound["bound_seconds"]
        prefill = st["seconds_prefill_new"] + st["seconds_prefill_recompute"]
        cells = [
            s.name, f"x{s.memory_x}", f"{r.seconds:,.1f}", f"{b:,.1f}", f"{r.seconds / b:.3f}",
            f"{st['decode_iterations']:,}", f"{st['prefill_iterations']:,}", f"{prefill:,.1f}",
            f"{st['seconds_prefill_recompute']:,.1f}", f"{st['seconds_decode']:,.1f}",
            f"{st['seconds_idle']:,.1f}", str(st["retractions"]),
        ]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
        print(out[-1], flush=True)
    CONSTRUCTED_RESULTS.mkdir(parents=True, exist_ok=True)
    (CONSTRUCTED_RESULTS / "constructed_schedule.md").write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
