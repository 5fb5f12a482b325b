"""The run folder: append-only JSONL records and an atomically replaced summary.

- trajectories.jsonl: one line per finished agent, written with a single write() of a whole
  line and fsync'd, so a SIGKILL leaves at most one torn LAST line; on open that torn tail is
  cut off (and saved to torn.jsonl.partial for inspection). Resume skips the task ids found.
- errors.jsonl: bad task records and agent failures (one line each, what and where).
- summary.json, written to a temp file and renamed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


def _repair(path: Path) -> int:
    """Cut a torn last line. Returns the number of bytes removed."""
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        with path.with_name(path.name + ".torn").open("ab") as t:
            t.write(data[keep:] + b"\n")
        f.truncate(keep)
        return len(data) - keep


def _append(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write per line: O_APPEND keeps lines whole and in order
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)


class RunStore:
    def __init__(self, root: Path, retry_errors: bool = False) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.trajectories = root / "trajectories.jsonl"
        self.errors = root / "errors.jsonl"
        self.summary = root / "summary.json"
        self.control = root / "control.jsonl"
        self.log = root / "run.log"
        self.repaired_bytes = _repair(self.trajectories) + _repair(self.errors)
        self.finished: dict[str, dict[str, Any]] = {}
        self.retried: list[str] = []
        self._load(retry_errors)

    def _load(self, retry_errors: bool) -> None:
        if not self.trajectories.exists():
            return
        keep: list[str] = []
        with self.trajectories.open(encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    tid = rec["task_id"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # not ours to judge; left in place
                if retry_errors and rec.get("status") == "error":
                    self.retried.append(tid)
                    _append(self.errors, {"kind": "previous_attempt", **rec})
                    continue
                keep.append(line)
                self.finished[tid] = rec
        if self.retried:  # rewrite without the error lines, atomically
            tmp = self.trajectories.with_name("trajectories.jsonl.tmp")
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, self.trajectories)

    def add_trajectory(self, record: dict[str, Any]) -> None:
        record = {"format": FORMAT_VERSION, **record}
        _append(self.trajectories, record)
        self.finished[record["task_id"]] = record

    def add_error(self, record: dict[str, Any]) -> None:
        _append(self.errors, {"time": time.time(), **record})

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary, summary)
