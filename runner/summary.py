"""summary.json: the one place that computes a run's totals and builds its summary.

Totals are computed from the finished records in the run folder (earlier sessions included),
so a resumed run reports the whole batch; `this_session` covers this process only. Every
engine, the simulator included, writes this one schema; engine-specific counters go under
`engine.stats`.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from tools.sandbox import limits_in_force

from .engine import Engine, EngineStats
from .records import evaluated
from .rewards import pass_at_k

if TYPE_CHECKING:  # annotations only: the batch imports nothing of this module
    from .batch import Batch


def record_totals(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Counts and token totals over finished trajectory records."""
    recs = list(records)
    by_status: dict[str, int] = {}
    for r in recs:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    prompt = sum(r.get("prompt_tokens", 0) for r in recs)
    cached = sum(r.get("cached_tokens", 0) for r in recs)
    evals = [r["eval"] for r in recs if evaluated(r)]
    return {
        "finished": len(recs),
        "agents_by_status": by_status,
        "solved": sum(1 for e in evals if e.get("solved")),
        "evaluated": len(evals),
        "steps": sum(r.get("steps", 0) for r in recs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": sum(r.get("completion_tokens", 0) for r in recs),
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "pass_at_k": pass_at_k(recs),  # None without eval
    }


def batch_totals(
    finished: Mapping[str, dict[str, Any]],
    task_ids: list[str],
    invalid_records: int,
    interrupted: bool,
    wall_seconds: float,
) -> dict[str, Any]:
    """The head of every summary: the selected tasks' totals over the finished records."""
    totals = record_totals(finished[t] for t in task_ids if t in finished)
    return {
        "tasks": len(task_ids),
        "invalid_records": invalid_records,
        **totals,
        "unfinished": len(task_ids) - totals["finished"],
        "interrupted": interrupted,
        "wall_seconds": round(wall_seconds, 3),
    }


def build_summary(
    batch: Batch,
    engine: Engine,
    why: str,
    *,
    task_ids: list[str],
    invalid_records: int,
    wall_seconds: float,
    batch_seconds: float,
    virtual_time: bool,
    interrupted: bool,
    config: dict[str, Any],
) -> dict[str, Any]:
    """The summary of a batch over the selected tasks (`task_ids`)."""
    return {
        **batch_totals(batch.store.finished, task_ids, invalid_records, interrupted, wall_seconds),
        # loop time of this session's batch: wall-clock, or simulated seconds on virtual time
        "batch_seconds": round(batch_seconds, 3),
        "clock": "virtual" if virtual_time else "wall",
        **session_parts(batch, engine, why),
        "config": config,
        "host": {"python": platform.python_version(), "machine": platform.machine()},
    }


def session_parts(batch: Batch, engine: Engine, why: str) -> dict[str, Any]:
    """What one batch process reports of its session: its totals, engine, gate and sandbox
    (a worker of a batch over many nodes sends these to the driver)."""
    session = batch.totals
    bound = batch.workspace_bound()
    # the workspaces' filesystem kind in force: "watch" if any fell back to it
    fs = "watch" if bound["exact"] is False else batch.config.workspace_fs
    return {
        "this_session": {
            "agents_run": sum(session.by_status.values()),
            "agents_by_status": dict(session.by_status),
            "requests": session.requests,
            "prompt_tokens": session.prompt,
            "cached_tokens": session.cached,
            "generated_tokens": session.generated,
        },
        "engine": {
            "name": engine.name,
            "model": engine.model,
            "why": why,
            "context_limit": engine.context_limit,
            "cache": engine.cache_stats().extra,
            "stats": engine.stats() if isinstance(engine, EngineStats) else None,
        },
        "workspace_bound": bound,  # exact or watched (docs/sandbox.md)
        "gate": batch.controller.summary(),
        "sandbox": batch.sandbox.mode,
        # what really bounds the agents here (root/user/none, memory, processes, network)
        "limits": limits_in_force(batch.sandbox, batch.config.limits, fs),
    }
