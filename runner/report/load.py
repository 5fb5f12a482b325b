"""Read a run folder for reporting: never writes, never takes the run's lock (a report of a
run in progress is allowed), and names the file and line of anything it cannot read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ReportError(ValueError):
    """A run folder that cannot be reported on; the message names what and where."""


@dataclass
class Run:
    root: Path
    source: str | None  # the dataset the folder belongs to (run.json)
    dataset_hash: str | None  # a hash of the dataset, where the run recorded one
    summary: dict[str, Any] | None  # None: the run never wrote one (killed before its end)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # task id -> record
    torn_tail: bool = False  # the last line was half-written (a run in progress or killed)

    @property
    def name(self) -> str:
        return str(self.root)


def load_run(path: Path, *, with_messages: bool = False) -> Run:
    """The run folder at `path`. Records keep only what a report shows unless
    `with_messages` (the viewer needs the messages and step logs)."""
    if not path.exists():
        raise ReportError(f"{path}: no such run folder")
    if not path.is_dir():
        raise ReportError(f"{path}: not a run folder (a file; pass the folder that holds it)")
    traj = path / "trajectories.jsonl"
    if not traj.is_file():
        raise ReportError(f"{path}: not a run folder (no trajectories.jsonl)")
    meta = _read_json(path / "run.json") or {}
    run = Run(
        path,
        meta.get("source"),
        meta.get("dataset_hash"),
        _read_json(path / "summary.json"),
    )
    for rec, torn in _records(traj):
        if torn:
            run.torn_tail = True
            continue
        if not with_messages:
            rec.pop("messages", None)
            rec.pop("step_log", None)
        run.records[rec["task_id"]] = rec  # a later line of the same task wins
    return run


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: cannot read it: {e}") from None
    if not isinstance(obj, dict):
        raise ReportError(f"{path}: not a JSON object")
    return obj


def _records(path: Path) -> Iterator[tuple[dict[str, Any], bool]]:
    """(record, torn) per line. A half-written LAST line (no newline) is a run in progress
    or a kill, not corruption: reported as torn. Any other bad line is an error."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):
                    yield {}, True
                    return
                raise ReportError(f"{path}:{n}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("task_id"), str):
                raise ReportError(f"{path}:{n}: not a trajectory record (no task_id)")
            yield rec, False


def control_lines(path: Path) -> list[dict[str, Any]]:
    """control.jsonl of a run folder ([] when there is none). A torn last line is skipped."""
    f = path / "control.jsonl"
    if not f.exists():
        return []
    out: list[dict[str, Any]] = []
    lines = f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not line.endswith("\n"):
                break
            raise ReportError(f"{f}:{n}: not a JSON control line ({e})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("t"), int | float):
            raise ReportError(f"{f}:{n}: not a control line (no time t)")
        out.append(rec)
    return out


def base_id(task_id: str) -> str:
    """The task a sample belongs to: `--samples N` runs ids `<task>#<k>`."""
    return task_id.rpartition("#")[0] if "#" in task_id else task_id


def reward(rec: dict[str, Any]) -> float | None:
    """A trajectory's reward: its own `reward` where the run wrote one, else 1/0 from its
    eval; None when it was not evaluated."""
    r = rec.get("reward")
    if isinstance(r, int | float) and not isinstance(r, bool):
        return float(r)
    ev = rec.get("eval")
    if isinstance(ev, dict) and ev.get("solved") is not None:  # format 2: null without eval
        return 1.0 if ev["solved"] else 0.0
    return None


def solved(rec: dict[str, Any]) -> bool | None:
    """Solved (reward 1, or the eval passed); None when not evaluated."""
    ev = rec.get("eval")
    if isinstance(ev, dict) and ev.get("solved") is not None:
        return bool(ev["solved"])
    r = reward(rec)
    return None if r is None else r >= 1.0
