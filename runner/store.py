"""The run folder: append-only JSONL records and an atomically replaced summary.

- trajectories.jsonl: one line per finished agent, written with a single write() of a whole
  line and fsync'd, so a SIGKILL leaves at most one torn LAST line; on open that torn tail is
  cut off (and kept in trajectories.jsonl.torn for inspection). Resume skips the task ids
  found. Rewriting it (retried errors, re-scored evals) goes through `rewrite_trajectories`
  only: a new file, fsync'd, renamed over the old one.
- errors.jsonl: bad task records and agent failures (one line each, what and where).
- summary.json, written to a temp file and renamed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
log = logging.getLogger("concur")


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


class RunFolderWriteError(OSError):
    """A write to the run folder failed (disk full, I/O error): the batch must stop. The
    message names the file and the free space; nothing half-written is left."""


def _write_error(path: Path, e: OSError) -> RunFolderWriteError:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    err = RunFolderWriteError(f"cannot write {path}: {e.strerror or e} ({free} on its filesystem)")
    err.errno = e.errno  # the message alone in str(), the cause still inspectable
    return err


def _append(path: Path, record: dict[str, Any]) -> None:
    """One line, written whole and fsync'd before this returns; on failure the file is cut
    back to where it was, so a line is either all there (and synced) or not at all."""
    # backslashreplace: a lone surrogate (models write "\ud800") becomes a JSON escape that
    # reads back unchanged, instead of an encoding error that would lose the record
    line = _dumps(record).encode("utf-8", "backslashreplace")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        size = os.fstat(fd).st_size  # one writer per run folder (the lock): stays valid
        try:
            written = os.write(fd, line)  # one write per line: O_APPEND keeps lines whole
            while written < len(line):  # a short write (disk nearly full): finish the line
                written += os.write(fd, line[written:])
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # no torn line left behind
            raise _write_error(path, e) from None
    finally:
        os.close(fd)


def _replace_durably(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync it, rename it over `path`, fsync the
    folder: a crash leaves the old file or the new one, never a mix or an empty one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()  # no empty or partial temp file left
        raise _write_error(path, e) from None


def write_json_atomic(path: Path, obj: Any) -> None:
    _replace_durably(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def _same_path(a: str, b: str) -> bool:
    try:
        return a == b or Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, default=str) + "\n"


class RunFolderBusy(RuntimeError):
    """Another process is writing this run folder."""


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # One writer per run folder: two runs appending to the same files would duplicate
        # every task and delete each other's live workspaces.
        self._lock = (root / ".lock").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RunFolderBusy(
                f"{root} is in use by another run (lock {root / '.lock'}); wait for it to end "
                "or choose another --out"
            ) from None
        self.trajectories = root / "trajectories.jsonl"
        self.errors = root / "errors.jsonl"
        self.summary = root / "summary.json"
        self.control = root / "control.jsonl"
        self.log = root / "run.log"
        self.repaired_bytes = _repair(self.trajectories) + _repair(self.errors)
        self.finished: dict[str, dict[str, Any]] = {}
        self._known_errors: set[str] | None = None  # errors.jsonl's records, read when needed
        self._load()

    def _load(self) -> None:
        if not self.trajectories.exists():
            return
        with self.trajectories.open(encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    self.finished[rec["task_id"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # not ours to judge; left in place

    def retry_errors(self, task_ids: set[str]) -> list[str]:
        """Forget the 'error' records of these tasks so they run again: their lines move to
        errors.jsonl (kind previous_attempt) and trajectories.jsonl is rewritten. Records of
        other tasks are left alone. Returns the ids that will run again."""
        retry = {t for t in task_ids if self.finished.get(t, {}).get("status") == "error"}
        if not retry:
            return []

        def drop(rec: dict[str, Any]) -> dict[str, Any] | None:
            if rec.get("task_id") not in retry:
                return rec
            _append(self.errors, {"kind": "previous_attempt", **rec})
            return None

        self.rewrite_trajectories(drop)
        return sorted(retry)

    def rewrite_trajectories(
        self, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> None:
        """Rewrite trajectories.jsonl durably with `change` applied to every record (None:
        drop it); lines that are not records are kept as they are. `finished` follows."""
        out: list[str] = []
        with self.trajectories.open(encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    tid = rec["task_id"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    out.append(line)  # not ours to judge: kept as it is
                    continue
                new = change(rec)
                if new is None:
                    self.finished.pop(tid, None)
                    continue
                if new is not rec:
                    line = _dumps(new)
                out.append(line)
                self.finished[tid] = new
        _replace_durably(self.trajectories, "".join(out))

    def bind_source(self, source: str, sha256: str | None = None) -> None:
        """Record which dataset this run folder belongs to; refuse another one (task ids
        like "0", "1" would otherwise be taken as finished). A local dataset is its resolved
        path or its content (`sha256`): the same file typed another way, or moved, is the same
        dataset; an edited one at the same path too (a fixed record runs), with a warning."""
        meta = self.root / "run.json"
        known: dict[str, Any] = {}
        if meta.exists():
            try:
                known = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                known = {}
        if not isinstance(known, dict) or known.get("source") is None:
            write_json_atomic(meta, {"format": FORMAT_VERSION, "source": source, "sha256": sha256})
            return
        same_path = _same_path(known["source"], source)
        same_content = sha256 is not None and known.get("sha256") == sha256
        if not (same_path or same_content):
            raise RunFolderBusy(
                f"{self.root} holds a run of {known['source']}, not of {source}: pass another --out"
            )
        if known.get("sha256") not in (None, sha256):
            log.warning(
                "%s changed since this run folder was started: finished tasks keep their "
                "records, the others run from the file as it is now",
                source,
            )
        if (known["source"], known.get("sha256")) != (source, sha256):
            write_json_atomic(meta, {**known, "source": source, "sha256": sha256})

    def add_trajectory(self, record: dict[str, Any]) -> None:
        record = {"format": FORMAT_VERSION, **record}
        _append(self.trajectories, record)
        self.finished[record["task_id"]] = record

    def add_error(self, record: dict[str, Any]) -> None:
        _append(self.errors, {"time": time.time(), **record})

    def add_error_once(self, record: dict[str, Any]) -> bool:
        """add_error unless errors.jsonl already holds this very record (the same bad task
        record is found again on every rerun). -> whether it was written."""
        if self._known_errors is None:
            self._known_errors = set()
            if self.errors.exists():
                with self.errors.open(encoding="utf-8", errors="replace") as f:
                    for line in f:
                        try:
                            rec = json.loads(line)
                            rec.pop("time", None)
                            self._known_errors.add(_dumps(rec))
                        except (json.JSONDecodeError, AttributeError):
                            continue
        key = _dumps(record)
        if key in self._known_errors:
            return False
        self._known_errors.add(key)
        self.add_error(record)
        return True

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary, summary)
