"""Run the real runner (agent loop, gate, policy, store) against the simulated engine on a
virtual clock: minutes of simulated GPU time in seconds of wall time, deterministically.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batch import Batch, BatchConfig
from ..engine import SamplingParams
from ..engines.chatml_tokenizer import ChatMLTokenizer
from ..policies import Policy
from ..store import RunStore, write_json_atomic
from .engine import deployment as sim_deployment
from .engine import make_sim_engine
from .engine.presets import _DEPLOYMENT_FIELDS as DEPLOYMENT_FIELDS
from .tools import SIM_TOOLS, NullSandbox
from .vclock import run_virtual
from .workload import SimModel, Workload

# Generous: the simulated model decides each reply's length from the trace.
SIM_SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=4096)


@dataclass
class SimResult:
    deployment: str
    workload: str
    policy: str
    policy_params: dict[str, Any]
    sim_seconds: float
    wall_seconds: float
    hit_rate: float | None
    device_hit_rate: float | None
    engine: dict[str, Any]
    gate: dict[str, Any]
    agents: dict[str, float]  # per-agent means: tool, gate wait, engine time
    # (steps, final context tokens, generated tokens) per agent: the identical-work check
    work: dict[str, tuple[int, int, int]] = field(repr=False, default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    out: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("work")
        return d


def simulate(
    workload: Workload,
    deployment: str,
    policy: Policy,
    out: Path,
    *,
    control_period: float = 5.0,
    pause_rule: str = "newest",
    resume_rule: str = "oldest",
    engine_options: dict[str, Any] | None = None,
    label: str | None = None,
) -> SimResult:
    """One simulated batch. `out` is replaced by a fresh run folder."""
    if out.exists():
        shutil.rmtree(out)
    store = RunStore(out)
    tok = ChatMLTokenizer()
    model = SimModel(workload, tok)
    config = BatchConfig(
        max_steps=max(len(a.steps) for a in workload.agents),
        sampling=SIM_SAMPLING,
        tools=("sim_tool", "submit"),
        tool_registry=SIM_TOOLS,
        control_period=control_period,
        pause_rule=pause_rule,
        resume_rule=resume_rule,
    )
    wall0 = time.perf_counter()

    options = dict(engine_options or {})
    if "hicache_ratio" in options or "hicache_size" in options:
        dep = sim_deployment(
            deployment, **{k: v for k, v in options.items() if k in DEPLOYMENT_FIELDS}
        )
        ratio = options.pop("hicache_ratio", 0)
        size_gb = options.pop("hicache_size", 0)
        if size_gb:  # SGLang's --hicache-size: GB of host pool per rank; overrides the ratio
            options["hicache_tokens"] = int(size_gb * 1e9 // dep.kv_bytes_per_token_per_gpu)
        else:  # --hicache-ratio: x the device pool
            options["hicache_tokens"] = int(ratio * dep.pool_tokens)

    async def main() -> tuple[float, dict[str, Any], dict[str, Any]]:
        engine = make_sim_engine(deployment, tok, model, **options)
        batch = Batch(workload.tasks(), engine, NullSandbox(), policy, store, config)
        t0 = asyncio.get_running_loop().time()
        try:
            await batch.run()
        finally:
            await engine.aclose()
        return asyncio.get_running_loop().time() - t0, engine.stats(), batch.controller.summary()

    sim_seconds, engine_stats, gate = run_virtual(main())
    recs = list(store.finished.values())
    prompt = sum(r.get("prompt_tokens", 0) for r in recs)
    cached = sum(r.get("cached_tokens", 0) for r in recs)
    host = engine_stats.get("host_hit_tokens", 0)
    by_status: dict[str, int] = {}
    for r in recs:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    result = SimResult(
        deployment=deployment,
        workload=workload.name,
        policy=label or policy.name,
        policy_params=policy.params(),
        sim_seconds=round(sim_seconds, 3),
        wall_seconds=round(time.perf_counter() - wall0, 3),
        hit_rate=round(cached / prompt, 4) if prompt else None,
        device_hit_rate=round((cached - host) / prompt, 4) if prompt else None,
        engine=engine_stats,
        gate=gate,
        agents={
            k: round(statistics.fmean(r.get(k, 0.0) for r in recs), 3)
            for k in ("tool_seconds", "wait_seconds", "gen_seconds", "seconds")
        },
        work={
            r["task_id"]: (
                r.get("steps", 0),
                r.get("context_tokens", 0),
                r.get("completion_tokens", 0),
            )
            for r in recs
        },
        by_status=by_status,
        out=str(out),
    )
    write_json_atomic(store.summary, {"simulation": result.to_json()})
    return result
