"""The run folder: append-only JSONL records and an atomically replaced summary.

- trajectories.jsonl: one line per finished agent, written with a single write() of a whole
  line and fsync'd, so a SIGKILL leaves at most one torn LAST line; on open that torn tail is
  cut off (and kept in trajectories.jsonl.torn for inspection). Resume skips the task ids
  found. Rewriting it (retried errors, re-scored evals) goes through `rewrite_trajectories`
  only: a new file, fsync'd, renamed over the old one.
- rollouts.jsonl: the token-level record of each finished agent (runner/runfolder/records.py),
  written the same way just BEFORE its trajectory line (the trajectory line is what marks the agent
  done), so a kill can leave rollout lines without a trajectory only at the end of the file
  (one, or a driver's batch); they are cut on open. Rewrites stream (new file, fsync'd,
  renamed): it can be large.
- errors.jsonl: bad task records and agent failures (one line each, what and where).
- control.jsonl: one line per control period (not fsync'd: a lost last period loses no work).
- summary.json, written to a temp file and renamed.

A write that fails (disk full, I/O error) raises RunFolderWriteError naming the file and the
free space, after cutting the file back to where it was (appends) or removing the temp file
(replacements): what was reported written stays, nothing half-written is left. The batch
stops on it (runner/batch/session.py).

During a batch every append runs on one writer thread of the store (`finish`, `log_error`,
`log_control`, `off_loop`), never on the event loop: an fsync waits for the disk
(milliseconds, far more on a busy or network disk) and would stall every agent and the gate
meanwhile (bench/loop_lag.py, docs/outputs.md). One thread keeps the appends in order and
one at a time, which the cut-back on failure needs; lines asked for while it writes go
together next (group commit: still one write per line, one fsync per file per group).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

FORMAT_VERSION = 2  # runner/runfolder/records.py: FORMAT
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
    """One line, written whole and fsync'd before this returns."""
    _append_many(path, [record])


def _append_many(path: Path, records: list[dict[str, Any]]) -> None:
    """Append lines, each with one write(), then one fsync for all of them (a driver writing
    a worker's report: one sync per report, not per line). On failure the file is cut back
    to where it was: the lines are either all there (and synced) or none is. Blocks: on the
    event loop, go through RunStore.off_loop."""
    _append_lines(path, [_line(r) for r in records], sync=True)


def _line(record: dict[str, Any]) -> bytes:
    # backslashreplace: a lone surrogate (models write "\ud800") becomes a JSON escape that
    # reads back unchanged, instead of an error losing the record
    return _dumps(record).encode("utf-8", "backslashreplace")


def _append_lines(path: Path, lines: list[bytes], sync: bool) -> None:
    """_append_many of lines already encoded."""
    if not lines:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        size = os.fstat(fd).st_size  # one writer per run folder (the lock): stays valid
        try:
            for line in lines:
                written = os.write(fd, line)  # one write per line: O_APPEND keeps it whole
                while written < len(line):  # a short write (disk nearly full): finish it
                    written += os.write(fd, line[written:])
            if sync:
                os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # no torn line left behind
            raise _write_error(path, e) from None
    finally:
        os.close(fd)


def _replace_durably(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync it, rename it over `path`, fsync the
    folder: a crash leaves the old file or the new one, never a mix or an empty one; a failed
    write (disk full) leaves the old file and no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _write_error(path, e) from None


def _lines_backwards(f: Any, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of a file's lines from the last one back; the
    file ends with a newline (repaired)."""
    pos, buf = end, b""
    while pos > 0:
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        buf = f.read(step) + buf
        # every complete line in buf except the first (which may start before pos)
        while True:
            cut = buf.rfind(b"\n", 0, len(buf) - 1)
            if cut < 0:
                break
            yield pos + cut + 1, buf[cut + 1 : -1]
            buf = buf[: cut + 1]
    if buf:
        yield 0, buf[:-1]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    _replace_durably(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


def _same_path(a: str, b: str) -> bool:
    try:
        return a == b or Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, default=str) + "\n"


async def _whole(job: asyncio.Future[T]) -> T:
    """Await a write on the writer thread. Cancelled meanwhile, still wait for it to end
    before the cancellation goes on: a thread cannot be stopped mid-write, and a line on
    disk must be known (`finished`) before the batch stops and sums up."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise


@dataclass
class _Commit:
    lines: list[tuple[Path, dict[str, Any]]]  # in the order they must reach the disk
    finished: dict[str, Any] | None  # the trajectory among them: an agent done once synced
    done: asyncio.Future[None]


def _write_group(group: list[_Commit]) -> list[Exception | None]:
    """(On the writer thread.) The lines of several commits, file by file in `_RANK` order
    (errors, other record files such as rollouts, trajectories, control: whatever order the
    commits came in, no trajectory line reaches the disk before its rollout), each file's
    lines written one by one and synced once (control.jsonl: not synced). A commit whose
    line failed gets the error, and its later lines are not written; one that cannot be
    encoded fails alone. -> per commit: None or its error."""
    failed: list[Exception | None] = [None] * len(group)
    encoded: dict[Path, list[tuple[int, bytes]]] = {}
    for i, c in enumerate(group):
        try:
            lines = [(path, _line(rec)) for path, rec in c.lines]
        except Exception as e:  # a record json cannot hold: that agent's, not the group's
            failed[i] = e
            continue
        for path, line in lines:
            encoded.setdefault(path, []).append((i, line))
    for path in sorted(encoded, key=lambda p: _RANK.get(p.name, 1)):
        todo = [(i, line) for i, line in encoded[path] if failed[i] is None]
        try:
            _append_lines(path, [line for _, line in todo], sync=path.name != "control.jsonl")
        except RunFolderWriteError as e:
            for i, _ in todo:
                failed[i] = e
    return failed


# the order of files in a group commit: what must be on disk before the trajectory line that
# marks an agent done (its error, its other record files) comes first
_RANK = {"errors.jsonl": 0, "trajectories.jsonl": 2, "control.jsonl": 3}


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
        self.rollouts = root / "rollouts.jsonl"
        # the one thread that writes during a batch (started on the first write), the lines
        # waiting for it, whether it is writing a group of them (see _commit)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-folder")
        self._waiting: list[_Commit] = []
        self._committing = False
        self.repaired_bytes = (
            _repair(self.trajectories) + _repair(self.errors) + _repair(self.rollouts)
        )
        self.finished: dict[str, dict[str, Any]] = {}
        self._known_errors: set[str] | None = None  # errors.jsonl's records, read when needed
        self._load()
        self.repaired_bytes += self._cut_orphan_rollout()

    def _cut_orphan_rollout(self) -> int:
        """A kill between rollout lines and their trajectory lines (one agent's, or a batch
        of them from a driver of many nodes) leaves those rollouts last in the file, for
        agents that are not finished (they run again): cut them, back to the last rollout
        of a finished agent."""
        if not self.rollouts.exists():
            return 0
        with self.rollouts.open("rb+") as f:
            end = keep = f.seek(0, os.SEEK_END)
            orphans: list[bytes] = []
            for start, line in _lines_backwards(f, end):
                try:
                    tid = json.loads(line)["task_id"]
                except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                    break  # not ours to judge: stop here
                if tid in self.finished:
                    break
                orphans.append(line)
                keep = start
            if keep == end:
                return 0
            with self.rollouts.with_name(self.rollouts.name + ".torn").open("ab") as t:
                t.write(b"".join(line + b"\n" for line in reversed(orphans)))
            f.truncate(keep)
            return end - keep

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
        self.rewrite_rollouts(lambda rec: None if rec.get("task_id") in retry else rec)
        return sorted(retry)

    def rewrite_rollouts(self, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
        """Rewrite rollouts.jsonl durably, streaming (the file can be large), with `change`
        applied to every record (None: drop it)."""
        if not self.rollouts.exists():
            return
        tmp = self.rollouts.with_name(self.rollouts.name + ".tmp")
        with self.rollouts.open(encoding="utf-8") as src, tmp.open("w", encoding="utf-8") as dst:
            for line in src:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    dst.write(line)
                    continue
                new = change(rec)
                if new is not None:
                    dst.write(line if new is rec else _dumps(new))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.rollouts)
        _fsync_dir(self.rollouts.parent)

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

    def bind_source(
        self, source: str, record: dict[str, Any] | None = None, sha256: str | None = None
    ) -> dict[str, Any]:
        """Record which dataset this run folder belongs to; refuse another one (task ids
        like "0", "1" would otherwise be taken as finished). A local dataset is its resolved
        path or its content (`sha256`): the same file typed another way, or moved, is the same
        dataset; an edited one at the same path too (a fixed record runs), with a warning.
        The first run also writes its `record` (config, versions, ...) into run.json, which
        is otherwise only updated for the dataset's path and hash. Returns run.json's content."""
        meta = self.root / "run.json"
        if meta.exists():
            try:
                known = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                known = None
            if not isinstance(known, dict):
                return {}
            if known.get("source") is not None:
                return self._same_source(meta, known, source, sha256)
            return known
        first = {"format": FORMAT_VERSION, "source": source, "sha256": sha256, **(record or {})}
        write_json_atomic(meta, first)
        return first

    def _same_source(
        self, meta: Path, known: dict[str, Any], source: str, sha256: str | None
    ) -> dict[str, Any]:
        same_path = _same_path(known["source"], source)
        if not (same_path or (sha256 is not None and known.get("sha256") == sha256)):
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
            known = {**known, "source": source, "sha256": sha256}
            write_json_atomic(meta, known)
        return known

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

    async def off_loop(self, write: Callable[..., T], *args: Any) -> T:
        """Run `write(*args)` (blocking run-folder writes) on the store's writer thread, in
        turn with the other writes."""
        return await _whole(asyncio.get_running_loop().run_in_executor(self._writer, write, *args))

    async def finish(self, record: dict[str, Any], extra: Mapping[str, dict[str, Any]]) -> None:
        """A finished agent: its lines of other record files (`extra`: file name -> record,
        e.g. its rollout), then its trajectory line, which marks it done."""
        record = {"format": FORMAT_VERSION, **record}
        lines = [(self._record_file(name), rec) for name, rec in extra.items()]
        await self._commit([*lines, (self.trajectories, record)], finished=record)

    async def log_error(self, record: dict[str, Any]) -> None:
        await self._commit([(self.errors, {"time": time.time(), **record})])

    async def log_control(self, line: dict[str, Any]) -> None:
        """One control period's line (not fsync'd: a lost last period loses no work)."""
        await self._commit([(self.control, line)])

    async def _commit(
        self, lines: list[tuple[Path, dict[str, Any]]], finished: dict[str, Any] | None = None
    ) -> None:
        """Append `lines` (in this order), on the writer thread. Lines asked for while the
        thread writes go together once it is free (group commit): one write per line, one
        fsync per file for the whole group, and each caller returns once its lines are
        synced (or with the group's RunFolderWriteError: none of them counts as written)."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append(_Commit(lines, finished, done))
        if not self._committing:
            self._next_group()
        await _whole(done)

    def _next_group(self) -> None:
        group, self._waiting = self._waiting, []
        self._committing = True
        job = asyncio.get_running_loop().run_in_executor(self._writer, _write_group, group)
        job.add_done_callback(lambda job: self._group_done(group, job))

    def _group_done(
        self, group: list[_Commit], job: asyncio.Future[list[Exception | None]]
    ) -> None:
        self._committing = False
        try:
            failures = job.result()
        except BaseException as e:  # not a write error: the thread failed (a bug), all fail
            failures = [e if isinstance(e, Exception) else RuntimeError(str(e))] * len(group)
        for c, err in zip(group, failures, strict=True):
            if err is None and c.finished is not None:
                self.finished[c.finished["task_id"]] = c.finished
            if c.done.done():
                continue
            if err is None:
                c.done.set_result(None)
            else:
                c.done.set_exception(err)
        if self._waiting:
            self._next_group()

    def add_trajectories(self, records: list[dict[str, Any]]) -> None:
        """Several finished agents, synced once; each counts as finished only after."""
        records = [{"format": FORMAT_VERSION, **r} for r in records]
        _append_many(self.trajectories, records)
        for r in records:
            self.finished[r["task_id"]] = r

    def append_records(self, name: str, records: list[dict[str, Any]]) -> None:
        """Lines of another record file of this folder (`name`: a plain *.jsonl file name),
        each written whole, synced once."""
        _append_many(self._record_file(name), records)

    def _record_file(self, name: str) -> Path:
        if "/" in name or not name.endswith(".jsonl") or name.startswith("."):
            raise ValueError(f"not a record file name of a run folder: {name!r}")
        return self.root / name

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary, summary)
