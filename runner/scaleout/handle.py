"""The driver's record of one worker (driver.py keeps one per worker; summary.py reports it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..batch.progress import BatchStatus
from .protocol import Want, WorkerDone, WorkerInfo


@dataclass
class Handle:
    """The driver's view of one worker."""

    index: int
    actor: Any
    info: WorkerInfo | None = None
    want: Want | None = None
    status: BatchStatus | None = None
    done: WorkerDone | None = None
    lost: str | None = None
    kept: int = 0  # records of this worker written as the task's record
    discarded: int = 0
    put_back: list[str] = field(default_factory=list)
    by_status: dict[str, int] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.lost is None and self.done is None
