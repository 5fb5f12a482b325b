"""Run the real runner (agent loop, gate, policy, store) against the simulated engine on a
virtual clock: minutes of simulated GPU time in seconds of wall time, deterministically.

`sim_parts` builds what a simulated batch needs (tasks, engine, tools, sandbox); the CLI's
`--engine sim` and `simulate` (the benchmarks' entry point) both use it and then the same
batch and summary path as every engine (runner/batch/session.py).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batch.batch import Batch, BatchConfig
from ..batch.session import execute
from ..engines.chatml_tokenizer import ChatMLTokenizer
from ..engines.protocol import SamplingParams
from ..gate.control import DEFAULT_CONTROL_PERIOD
from ..policies.protocol import Policy
from ..runfolder.store import RunStore
from ..runfolder.summary import record_totals
from ..tasks.tasks import Task
from .engine import SimEngine, make_sim_engine
from .engine import deployment as sim_deployment
from .engine.presets import _DEPLOYMENT_FIELDS as DEPLOYMENT_FIELDS
from .tools import SIM_TOOLS, NullSandbox
from .vclock import run_virtual
from .workload import SimModel, Workload, synthetic

# Generous: the simulated model decides each reply's length from the trace.
SIM_SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=4096)
SIM_TOOL_NAMES = ("sim_tool", "submit")


def load_workload(spec: str, seed: int = 0) -> Workload:
    """A trace file (.jsonl, see workload.py) or a synthetic preset's name."""
    if Path(spec).suffix == ".jsonl":
        return Workload.load(Path(spec))
    return synthetic(spec, seed=seed)


@dataclass
class SimParts:
    tasks: list[Task]
    engine: SimEngine
    max_steps: int


def sim_parts(
    workload: Workload, deployment: str, engine_options: dict[str, Any] | None = None
) -> SimParts:
    """The tasks and the simulated engine of one simulated batch. `engine_options`: SimEngine
    and Deployment overrides, plus `hicache_ratio` (x the device pool) or `hicache_size`
    (GB of host pool per rank, SGLang's --hicache-size; wins over the ratio)."""
    options = dict(engine_options or {})
    ratio = options.pop("hicache_ratio", 0)
    size_gb = options.pop("hicache_size", 0)
    if ratio or size_gb:
        dep = sim_deployment(
            deployment, **{k: v for k, v in options.items() if k in DEPLOYMENT_FIELDS}
        )
        if size_gb:
            options["hicache_tokens"] = int(size_gb * 1e9 // dep.kv_bytes_per_token_per_gpu)
        else:
            options["hicache_tokens"] = int(ratio * dep.pool_tokens)
    tok = ChatMLTokenizer()
    engine = make_sim_engine(deployment, tok, SimModel(workload, tok), **options)
    return SimParts(workload.tasks(), engine, max(len(a.steps) for a in workload.agents))


def sim_config(parts: SimParts, **overrides: Any) -> BatchConfig:
    """The batch settings of a simulated run: the simulated tools, generous sampling."""
    return BatchConfig(
        max_steps=parts.max_steps,
        sampling=SIM_SAMPLING,
        tools=SIM_TOOL_NAMES,
        tool_registry=SIM_TOOLS,
        git_base=False,
        rollouts=False,  # synthetic token ids: nothing to train on
        **overrides,
    )


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


def sim_setup(
    workload: Workload,
    deployment: str,
    *,
    control_period: float,
    pause_rule: str,
    resume_rule: str,
    engine_options: dict[str, Any] | None,
) -> tuple[SimParts, BatchConfig]:
    """The tasks, engine and batch settings `simulate` runs
    (tests/integration/test_bench_cli.py holds the CLI's to them)."""
    parts = sim_parts(workload, deployment, engine_options)
    config = sim_config(
        parts, control_period=control_period, pause_rule=pause_rule, resume_rule=resume_rule
    )
    return parts, config


def simulate(
    workload: Workload,
    deployment: str,
    policy: Policy,
    out: Path,
    *,
    control_period: float = DEFAULT_CONTROL_PERIOD,
    pause_rule: str = "newest",
    resume_rule: str = "oldest",
    engine_options: dict[str, Any] | None = None,
    label: str | None = None,
) -> SimResult:
    """One simulated batch. `out` is replaced by a fresh run folder."""
    if out.exists():
        shutil.rmtree(out)
    store = RunStore(out)
    parts, config = sim_setup(
        workload,
        deployment,
        control_period=control_period,
        pause_rule=pause_rule,
        resume_rule=resume_rule,
        engine_options=engine_options,
    )
    batch = Batch(parts.tasks, parts.engine, NullSandbox(), policy, store, config)
    outcome = execute(
        batch,
        parts.engine,
        f"simulated {deployment}",
        task_ids=[t.id for t in parts.tasks],
        invalid_records=0,
        config={
            "workload": workload.name,
            "sim_deployment": deployment,
            "policy": policy.name,
            "control_period": control_period,
            "pause_rule": pause_rule,
            "resume_rule": resume_rule,
            "engine_options": engine_options or {},
        },
        run_loop=run_virtual,
    )
    if outcome.exit_code:  # a signal or a dead engine stopped it: its figures describe no batch
        by = outcome.summary.get("stopped_by")
        raise RuntimeError(
            f"the simulated batch of {workload.name} on {deployment} ({label or policy.name}) "
            f"stopped before every agent ended (exit code {outcome.exit_code}"
            f"{f', {by}' if by else ''}); no result; its run folder: {out}"
        )
    return sim_result(outcome.summary, store, workload, deployment, policy, label)


def sim_result(
    summary: dict[str, Any],
    store: RunStore,
    workload: Workload,
    deployment: str,
    policy: Policy,
    label: str | None = None,
) -> SimResult:
    """The figures the benchmarks read, from a simulated run's summary and records."""
    recs = list(store.finished.values())
    totals = record_totals(recs)
    stats = summary["engine"]["stats"]
    prompt, cached = totals["prompt_tokens"], totals["cached_tokens"]
    host = stats.get("host_hit_tokens", 0)
    return SimResult(
        deployment=deployment,
        workload=workload.name,
        policy=label or policy.name,
        policy_params=policy.params(),
        sim_seconds=summary["batch_seconds"],
        wall_seconds=summary["wall_seconds"],
        hit_rate=totals["hit_rate"],
        device_hit_rate=round((cached - host) / prompt, 4) if prompt else None,
        engine=stats,
        gate=summary["gate"],
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
        by_status=totals["agents_by_status"],
        out=str(store.root),
    )
