"""Longest first: the task order from a previous run of the same tasks (`--order-from`).

The gate admits waiting agents in task order, and when the window shrinks it pauses the most
recently admitted first, so the tasks late in the list wait the longest. When some of them are
long, the batch ends with a tail: a few long agents running nearly alone on an idle GPU. A
previous run of the same tasks (an earlier RL epoch, another seed or policy, an ablation) says
which were long; starting those first is LPT, the classic makespan rule. A task's length is
the seconds its agent spent generating and in tools there (its waits at the gate are left
out: they measure where it stood in that run's order, not the task). docs/gate.md, "Task
order", has the measured effect.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Lengths:
    """task id -> seconds, read from `source`; `unreadable`: lines that were not records."""

    source: Path
    seconds: dict[str, float]
    unreadable: int = 0


def previous_lengths(path: Path) -> Lengths:
    """Each task's generating and tool seconds in a previous run folder (or its
    trajectories.jsonl). The last record of a task wins, as on resume."""
    traj = path / "trajectories.jsonl" if path.is_dir() else path
    if not traj.is_file():
        raise ValueError(f"--order-from: {path} is not a run folder (no trajectories.jsonl)")
    seconds: dict[str, float] = {}
    unreadable = 0
    with traj.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                seconds.update([_length(json.loads(line))])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                unreadable += 1
    if not seconds:
        raise ValueError(f"--order-from: {traj} holds no trajectory record")
    return Lengths(traj, seconds, unreadable)


def _length(rec: dict) -> tuple[str, float]:
    tid = rec["task_id"]
    if not isinstance(tid, str):
        raise TypeError("task_id is not a string")
    return tid, float(rec["gen_seconds"]) + float(rec["tool_seconds"])


def longest_first(
    items: Sequence[T], seconds: Mapping[str, float], key: Callable[[T], str]
) -> list[T]:
    """The items with no recorded length first, in their order (nothing says they are short),
    then the others by their recorded seconds, longest first; equal ones keep their order."""
    unknown = [x for x in items if key(x) not in seconds]
    known = [x for x in items if key(x) in seconds]
    known.sort(key=lambda x: -seconds[key(x)])  # stable: ties keep their order
    return unknown + known


def describe(lengths: Lengths, items: Sequence[T], key: Callable[[T], str]) -> tuple[int, str]:
    """How many of `items` the previous run holds, and the log line saying what the order
    was taken from."""
    found = sum(1 for x in items if key(x) in lengths.seconds)
    if not found:
        return 0, (
            f"task order: none of the {len(items)} tasks is in {lengths.source} (another "
            "dataset?): the order is the dataset's"
        )
    line = (
        f"task order: longest first by their generating and tool seconds in {lengths.source} "
        f"({found} of {len(items)} tasks found there"
    )
    if found < len(items):
        line += f"; the {len(items) - found} others first, in their own order"
    if lengths.unreadable:
        line += f"; {lengths.unreadable} unreadable lines skipped"
    return found, line + ")"
