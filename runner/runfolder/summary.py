"""summary.json: the one place that computes a run's totals and builds its summary.

Totals are computed from the finished records in the run folder (earlier sessions included),
so a resumed run reports the whole batch; `this_session` covers this process only. Every
engine, the simulator included, writes this one schema; engine-specific counters go under
`engine.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from .records import evaluated


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


def pass_at_k(records: Iterable[dict[str, Any]]) -> dict[str, float] | None:
    """Unbiased pass@k (Chen et al. 2021, 1 - C(n-c, k) / C(n, k)) averaged over tasks, for
    k = 1, 2, 4, ... up to the smallest sample count of an evaluated task. None without eval."""
    groups: dict[str, list[bool]] = {}
    for r in records:
        if evaluated(r):
            groups.setdefault(r.get("task") or r["task_id"], []).append(bool(r["eval"]["solved"]))
    if not groups:
        return None
    n_min = min(len(v) for v in groups.values())
    ks = sorted({*(2**i for i in range(n_min.bit_length()) if 2**i <= n_min), n_min})
    out = {}
    for k in ks:
        est = [_pass_at_k(len(v), sum(v), k) for v in groups.values()]
        out[f"pass@{k}"] = round(sum(est) / len(est), 4)
    return out


def _pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
