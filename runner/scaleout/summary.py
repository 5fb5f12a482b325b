"""summary.json of a batch over many nodes: the single-process schema (runner/runfolder/summary.py),
totals from the run folder's records, plus `workers` (one entry per worker) and `scaleout`
(the driver's own figures)."""

from __future__ import annotations

import platform
from typing import Any

from ..gate.control import policy_sums
from ..runfolder.store import RunStore
from ..runfolder.summary import batch_totals
from .handle import Handle

SESSION_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")
GATE_SUMS = ("pauses", "resumes", "agent_seconds_paused", "agent_seconds_pending")


def distributed_summary(
    store: RunStore,
    handles: list[Handle],
    *,
    task_ids: list[str],
    invalid_records: int,
    wall_seconds: float,
    interrupted: bool,
    config: dict[str, Any],
    figures: dict[str, Any],
) -> dict[str, Any]:
    workers = [worker_entry(h) for h in handles]
    parts = [h.done.parts for h in handles if h.done is not None and "engine" in h.done.parts]
    session: dict[str, Any] = {
        "agents_run": sum(h.kept for h in handles),
        **{k: sum(p["this_session"][k] for p in parts) for k in SESSION_COUNTS},
    }
    virtual = bool(parts) and parts[0].get("clock") == "virtual"
    loop_seconds = [p["batch_seconds"] for p in parts if p.get("batch_seconds") is not None]
    return {
        **batch_totals(store.finished, task_ids, invalid_records, interrupted, wall_seconds),
        # simulated: the longest worker's virtual seconds (each worker has a clock of its own)
        "batch_seconds": round(max(loop_seconds) if virtual and loop_seconds else wall_seconds, 3),
        "clock": "virtual" if virtual else "wall",
        "this_session": session,
        "engine": parts[0]["engine"] if parts else None,
        "gate": merged_gate([p["gate"] for p in parts]),
        "sandbox": parts[0]["sandbox"] if parts else None,
        "workspace_bound": merged_bound([p.get("workspace_bound") for p in parts]),
        "limits": parts[0].get("limits") if parts else None,  # as "sandbox": the first worker's
        "config": config,
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "workers": workers,
        "scaleout": figures,
    }


def merged_bound(bounds: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The workers' workspace bounds: a worker's whose bound was not exact, if any."""
    known = [b for b in bounds if b is not None]
    return next((b for b in known if b["exact"] is False), known[0] if known else None)


def worker_entry(h: Handle) -> dict[str, Any]:
    parts = h.done.parts if h.done is not None else {}
    info = h.info
    return {
        "worker": h.index,
        "node_id": info.node_id if info else None,
        "host": info.host if info else None,
        "pid": info.pid if info else None,
        "records_kept": h.kept,
        "agents_by_status": h.by_status,
        "attempts_discarded": h.discarded,
        "lost": h.lost,
        "tasks_put_back": h.put_back,
        "this_session": parts.get("this_session"),
        "engine": parts.get("engine"),
        "gate": parts.get("gate"),
        "batch_seconds": parts.get("batch_seconds"),
    }


def merged_gate(gates: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One gate summary over the workers' gates: the first one's settings, counts summed;
    each worker's own under `workers`."""
    if not gates:
        return None
    out = dict(gates[0])
    for k in GATE_SUMS:
        out[k] = round(sum(g.get(k, 0) for g in gates), 3)
    out["control_periods"] = sum(g.get("control_periods", 0) for g in gates)
    out.update(policy_sums(gates))
    out.pop("window", None)  # per worker only: windows of different engines do not add up
    out["workers"] = gates
    return out
