"""Every bench row, the paper's and the stress suite's, and the records with a host tier."""

from __future__ import annotations

from typing import Any

from bench.common.paper_runs import TABLE1
from bench.common.stress_runs import ROWS


def every_row() -> list[tuple[str, str, str, str]]:
    """(key, title, deployment, workload) of every paper row and stress row."""
    out = [(c.key, c.title, c.deployment, c.workload) for c in TABLE1]
    return out + [(r.key, r.title, r.deployment, r.workload) for r in ROWS]


def host_run(record: dict[str, Any]) -> bool:
    """Whether a run's record had a host tier (HiCache)."""
    return "hicache" in record["system"]
