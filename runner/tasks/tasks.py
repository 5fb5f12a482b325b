"""Task datasets: one task per record, loaded from JSONL/JSON/Parquet/CSV, a `save_to_disk`
folder or a Hugging Face dataset name, through an optional field map (runner/tasks/formats.py).
Invalid and duplicate records are reported (file, line, reason) and skipped; the valid ones
run. SWE-bench-style records on a local repository: runner/tasks/swebench.py.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import swebench
from .formats import (
    BadRecord,
    MissingField,
    apply_field_map,
    is_saved_dataset,
    read_csv,
    read_saved_dataset,
)
from .swebench import SweSpec

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SHIPPED = Path(__file__).resolve().parent.parent.parent / "tasks"
KNOWN_FIELDS = {
    "id",
    "prompt",
    "messages",
    "system",
    "max_steps",
    "files",
    "setup",
    "eval",
    "metadata",
    "tools",
    "replay",
    "sampling",
    "workspace",
    "reward",
    *swebench.FIELDS,
}
# Fields that hold lists/objects; CSV (and some Parquet files) store them as JSON strings.
SAMPLING_FIELDS = {"temperature", "top_p", "max_new_tokens", "stop", "seed"}


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:  # 64.0 too: columnar formats may store integers as floats
    return _finite(v) and float(v).is_integer()


# A task's sampling overrides, checked at load as the run's options are at parse time
SAMPLING_CHECKS: dict[str, Callable[[Any], bool]] = {
    "temperature": lambda v: _finite(v) and v >= 0,
    "top_p": lambda v: _finite(v) and 0 < v <= 1,
    "max_new_tokens": lambda v: _integer(v) and v >= 1,
    "seed": lambda v: _integer(v) and v >= 0,
    "stop": lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
}
SAMPLING_RULES = {
    "temperature": "a number >= 0",
    "top_p": "a number in (0, 1]",
    "max_new_tokens": "an integer >= 1",
    "seed": "an integer >= 0",
    "stop": "a list of non-empty strings",
}
NESTED_FIELDS = {"messages", "files", "setup", "metadata", "tools", "replay", "sampling"}


class TaskSourceError(ValueError):
    """The dataset itself cannot be read (missing file, hub unreachable, bad format)."""


@dataclass
class Task:
    id: str
    messages: list[dict[str, str]]  # the opening conversation (system first if given)
    max_steps: int | None = None
    files: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    eval: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    workspace: str | None = None  # absolute path of a directory or archive to start from
    sampling: dict[str, Any] = field(default_factory=dict)  # overrides of the run's sampling
    reward: str | None = None  # command whose last output line is the reward (a float)
    # --samples N: this agent is sample `sample` of dataset task `dataset_id` (None: `id`)
    sample: int = 0
    dataset_id: str | None = None
    swe: SweSpec | None = None  # a SWE-bench-style record on a local repository


@dataclass
class RecordError:
    source: str
    line: int  # 1-based: the line a JSONL or CSV record starts on, else the record number
    task_id: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "task",
            "file": self.source,
            "line": self.line,
            "task_id": self.task_id,
            "reason": self.reason,
        }


def resolve_source(spec: str) -> tuple[str, str]:
    """-> (kind, location): kind is a `datasets` builder ("json", "csv", "parquet"), "disk"
    (a `save_to_disk` folder) or "hub"."""
    p = Path(spec)
    candidates = [p] if p.is_absolute() else [p, SHIPPED / p]
    for c in candidates:
        if is_saved_dataset(c):
            return "disk", str(c)
        if c.is_dir():
            raise TaskSourceError(
                f"{c} is a directory but not a dataset saved with `save_to_disk` (no "
                "dataset_dict.json, or state.json and dataset_info.json)"
            )
        if c.is_file():
            kind = LOCAL_SUFFIXES.get(c.suffix.lower())
            if kind is None:
                raise TaskSourceError(
                    f"{c}: unsupported file type {c.suffix!r}; use .jsonl, .json, .parquet or .csv"
                )
            return kind, str(c.resolve())  # one name however the path was typed
    if p.suffix.lower() in LOCAL_SUFFIXES or spec.startswith((".", "/")):
        tried = " or ".join(str(c) for c in candidates)
        raise TaskSourceError(f"task file not found: {tried}")
    return "hub", spec


def _read_records(kind: str, location: str, split: str) -> tuple[list[Any], list[int] | None]:
    """-> (records, the file line of each, where the format has lines)."""
    if kind == "json" and location.lower().endswith(".jsonl"):
        records = _read_jsonl(location)
        return records, None
    if kind == "csv":
        try:
            rows, lines = read_csv(location)
        except ValueError as e:
            raise TaskSourceError(f"cannot load tasks: {e}") from None
        return [_csv_types(r) for r in rows], lines
    if kind == "disk":
        try:
            return [_drop_struct_nulls(r) for r in read_saved_dataset(Path(location), split)], None
        except ValueError as e:
            raise TaskSourceError(str(e)) from None
    import datasets  # slow import: only when needed

    datasets.disable_progress_bars()
    try:
        if kind == "hub":
            ds = datasets.load_dataset(location, split=split)
        else:
            ds = datasets.load_dataset(kind, data_files=location, split="train")
    except Exception as e:  # the library raises many types; all mean "cannot read the source"
        hint = ""
        if kind == "hub":
            hint = (
                " (Hugging Face hub datasets need network access to the hub or a local "
                "cache; offline, pass a local .jsonl/.json/.parquet/.csv file)"
            )
        raise TaskSourceError(
            f"cannot load tasks from {location!r}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}{hint}"
        ) from None
    records = list(ds)
    if kind in ("parquet", "hub"):
        # Arrow structs have one schema for all rows: a key present in any row's object shows
        # up as None in every other row ({"a.py": "x", "b.py": None}). Drop those fillers.
        records = [_drop_struct_nulls(r) for r in records]
    return records, None


def _drop_struct_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_struct_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_struct_nulls(v) for v in value]
    return value


def _csv_types(rec: dict[str, Any] | BadRecord) -> Any:
    """`max_steps` is the one numeric field of a CSV file: every other cell stays text."""
    if isinstance(rec, dict) and "max_steps" in rec:
        rec["max_steps"] = _number(rec["max_steps"])
    return rec


def _number(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text.strip())
        except ValueError:
            pass
    return text  # validate() rejects it with the field name


_BLANK = object()  # a blank JSONL line: skipped, but it keeps the line numbering


def _read_jsonl(location: str) -> list[Any]:
    """Per line, so one bad line costs one task, and errors name the line."""
    out: list[Any] = []
    with open(location, "rb") as f:
        for raw in f:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # never replaced silently: ids would change
                out.append(_Bad(_not_utf8(raw, e)))
                continue
            if not line.strip():
                out.append(_BLANK)  # keeps numbering; skipped silently
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                out.append(_Bad(f"invalid JSON: {e.msg} at column {e.colno}"))
    return out


_Bad = BadRecord


def _not_utf8(raw: bytes, e: UnicodeDecodeError) -> str:
    return f"not UTF-8: byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line"


def _norm(key: str, value: Any) -> Any:
    """CSV/Parquet store nested fields as JSON strings or NaN-like empties: undo that.
    Only nested fields: a prompt or eval command that happens to look like JSON stays text."""
    if key in NESTED_FIELDS and isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    if value != value:  # NaN
        return None
    return value


# Ids name files and folders (workspaces, kept workspaces): a name is at most 255 bytes on
# Linux filesystems; the rest is room for suffixes.
MAX_ID_BYTES = 200


def check_id(tid: str) -> None:
    """ValueError unless `tid` can be a file name as it is (not too long, no path separators,
    no control characters, no surrounding blanks, not "." or "..") and is no sample id
    (no "#")."""
    size = len(tid.encode("utf-8", "surrogatepass"))
    if size > MAX_ID_BYTES:
        raise ValueError(f'"id" is {size} bytes long; at most {MAX_ID_BYTES} (ids name files)')
    bad = sorted({c for c in tid if c in "/\\" or unicodedata.category(c) in ("Cc", "Cs")})
    if bad:
        raise ValueError(
            f'"id" {tid!r} contains {", ".join(repr(c) for c in bad)}: no "/", "\\", '
            "control characters or lone surrogates (ids name files)"
        )
    if tid in (".", "..") or tid != tid.strip():
        raise ValueError(f'"id" {tid!r} must not be "." or ".." nor start or end with blanks')
    if "#" in tid:  # `<task>#<k>` is sample k of a task (--samples): a dataset id with "#"
        # would collide with one, and the report would count it as a sample of `<task>`
        raise ValueError(
            f'"id" {tid!r} contains "#", which is reserved for sample ids (<task>#<k> with '
            "--samples): rename the task"
        )


def validate(rec: Any, base: Path | None = None) -> Task:
    """A Task, or ValueError with the reason. `base`: the dataset file's directory, against
    which a `workspace` path is resolved (None for hub datasets: no `workspace` then)."""
    if not isinstance(rec, dict):
        raise ValueError(f"a task must be a JSON object, got {type(rec).__name__}")
    rec = {k: v for k, v in ((k, _norm(k, v)) for k, v in rec.items()) if v is not None}
    tid = rec.get("id")
    if isinstance(tid, int) and not isinstance(tid, bool):
        tid = str(tid)
    if tid is None or (isinstance(tid, str) and not tid.strip()):
        fields = ", ".join(sorted(map(str, rec))) or "no fields"
        raise ValueError(
            f'missing or empty "id" (the record has {fields}; --field-map id=FIELD names '
            "the one to use)"
        )
    if not isinstance(tid, str):
        raise ValueError(f'"id" must be a string or an integer, got {type(tid).__name__}')
    check_id(tid)
    prompt, msgs, system = rec.get("prompt"), rec.get("messages"), rec.get("system")
    if (prompt is None) == (msgs is None):
        raise ValueError(
            'exactly one of "prompt" or "messages" is required'
            + ("" if msgs is not None else " (--field-map prompt=FIELD names the one to use)")
        )
    if system is not None and not isinstance(system, str):
        raise ValueError('"system" must be a string')
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError('"prompt" must be a non-empty string')
        messages.append({"role": "user", "content": prompt})
    else:
        if not isinstance(msgs, list) or not msgs:
            raise ValueError('"messages" must be a non-empty list')
        for i, m in enumerate(msgs):
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            ):
                raise ValueError(f'messages[{i}] must be {{"role": str, "content": str}}')
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"messages[{i}] has unsupported role {m['role']!r}")
        if system and msgs[0]["role"] == "system":
            raise ValueError('both "system" and a system message in "messages"')
        messages += [{"role": m["role"], "content": m["content"]} for m in msgs]
        if messages[-1]["role"] != "user":
            raise ValueError('"messages" must end with a user message')
    max_steps = rec.get("max_steps")
    if max_steps is not None:
        if isinstance(max_steps, float) and max_steps.is_integer():
            max_steps = int(max_steps)
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f'"max_steps" must be an integer >= 1, got {max_steps!r}')
    files = rec.get("files") or {}
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise ValueError('"files" must map relative paths to string contents')
    for path in files:
        pp = Path(path)
        if pp.is_absolute() or ".." in pp.parts or not pp.parts:
            raise ValueError(f'"files" path {path!r} must be relative and stay in the workspace')
    setup = rec.get("setup") or []
    if isinstance(setup, str):
        setup = [setup]
    if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
        raise ValueError('"setup" must be a command string or a list of them')
    ev = rec.get("eval")
    if ev is not None and not isinstance(ev, str):
        raise ValueError('"eval" must be a command string')
    reward = rec.get("reward")
    if reward is not None and not (isinstance(reward, str) and reward.strip()):
        raise ValueError('"reward" must be a command string (its last output line a float)')
    for name, cmd in [
        *(("setup", c) for c in setup),
        ("eval", ev or ""),
        ("reward", reward or ""),
    ]:
        if "\0" in cmd:
            raise ValueError(f'"{name}" command contains a NUL character')
    meta = rec.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError('"metadata" must be an object')
    tools = rec.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, str) for t in tools)
    ):
        raise ValueError('"tools" must be a list of tool names')
    if tools is not None:
        from tools.registry import REGISTRY  # the tool names a task may ask for

        unknown = [t for t in tools if t not in REGISTRY]
        if unknown:
            raise ValueError(f'"tools" names unknown tools {unknown}; known: {sorted(REGISTRY)}')
    replay = rec.get("replay")
    if replay is not None and not (
        isinstance(replay, list) and all(isinstance(r, str) for r in replay)
    ):
        raise ValueError('"replay" must be a list of assistant message strings')
    workspace = _workspace_source(rec.get("workspace"), base)
    swe = swebench.parse_spec(rec, base)
    sampling = rec.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ValueError('"sampling" must be an object')
    bad = sorted(set(sampling) - SAMPLING_FIELDS)
    if bad:
        raise ValueError(f'"sampling" has unknown keys {bad}; known: {sorted(SAMPLING_FIELDS)}')
    for k, v in sampling.items():
        if not SAMPLING_CHECKS[k](v):
            raise ValueError(f'"sampling.{k}" has a bad value {v!r}: {SAMPLING_RULES[k]}')
    return Task(
        tid,
        messages,
        max_steps,
        files,
        setup,
        ev,
        meta,
        tools,
        rec,
        workspace,
        sampling,
        reward,
        swe=swe,
    )


def _workspace_source(value: Any, base: Path | None) -> str | None:
    """The `workspace` field: a directory or a .tar/.tar.gz/.tgz/.zip archive, relative to the
    dataset file's directory and inside it (a dataset must not make the runner copy host files
    such as ~/.ssh into a workspace)."""
    if value is None:
        return None
    from .formats import ARCHIVE_SUFFIXES, source_kind

    if not isinstance(value, str) or not value.strip():
        raise ValueError('"workspace" must be a path (a directory or an archive)')
    if base is None:
        raise ValueError('"workspace" needs a local dataset file (paths are relative to it)')
    if Path(value).is_absolute():
        raise ValueError(
            f'"workspace" {value!r} must be relative to the dataset file\'s directory {base}'
        )
    root = base.resolve()
    path = (root / value).resolve()
    if not path.is_relative_to(root):
        raise ValueError(
            f'"workspace" {value!r} resolves to {path}, outside the dataset file\'s directory '
            f"{root}; keep workspace sources next to the dataset"
        )
    if not path.exists():
        raise ValueError(f'"workspace" {value!r}: {path} does not exist')
    if source_kind(path) is None:
        raise ValueError(
            f'"workspace" {value!r}: {path} is neither a directory nor a '
            f"{'/'.join(ARCHIVE_SUFFIXES)} archive"
        )
    return str(path)


def load_tasks(
    spec: str,
    limit: int | None = None,
    task_ids: list[str] | None = None,
    split: str = "train",
    field_map: dict[str, str] | None = None,
) -> tuple[list[Task], list[RecordError], str]:
    """-> (valid tasks in dataset order, record errors, resolved source). `field_map`: task
    field -> record field (--field-map); a field it names that no record has is a
    TaskSourceError."""
    kind, location = resolve_source(spec)
    records, lines = _read_records(kind, location, split)
    tasks: list[Task] = []
    errors: list[RecordError] = []
    seen: dict[str, int] = {}
    unknown_fields: dict[str, int] = {}
    unmapped: list[RecordError] = []  # records lacking a field the field map reads
    swe_bad: list[RecordError] = []  # invalid SWE-bench records (instance_id, ...)
    for i, rec in enumerate(records):
        n = lines[i] if lines else i + 1
        if rec is _BLANK:
            continue
        if isinstance(rec, _Bad):
            errors.append(RecordError(location, n, None, rec.reason))
            continue
        swe_like = isinstance(rec, dict) and "instance_id" in rec
        try:
            rec = swebench.default_map(apply_field_map(rec, field_map or {}))
            task = validate(rec, None if kind == "hub" else Path(location).parent)
        except ValueError as e:
            tid = rec.get("id") if isinstance(rec, dict) else None
            err = RecordError(location, n, tid if isinstance(tid, str) else None, str(e))
            errors.append(err)
            if isinstance(e, MissingField):
                unmapped.append(err)
            elif swe_like:
                swe_bad.append(err)
            continue
        for k in rec:
            known = k in KNOWN_FIELDS or k in swebench.SWEBENCH_COLUMNS
            if not known or (k == "repo" and task.swe is None):
                unknown_fields[k] = unknown_fields.get(k, 0) + 1
        if task.id in seen:
            errors.append(
                RecordError(
                    location,
                    n,
                    task.id,
                    f"duplicate id {task.id!r} (first at line {seen[task.id]})",
                )
            )
            continue
        seen[task.id] = n
        tasks.append(task)
    if unmapped and not tasks:  # a field map that fits no record: the run cannot start
        first = unmapped[0]
        raise TaskSourceError(
            f"{first.source}:{first.line}: {first.reason} ({len(unmapped)} records lack a "
            "mapped field, and no record is valid)"
        )
    if swe_bad and not tasks:  # SWE-bench records none of which can run: say why, exit 1
        first = swe_bad[0]
        raise TaskSourceError(
            f"{first.source}:{first.line}: {first.reason} (no SWE-bench record of this "
            f"dataset is valid: {len(swe_bad)} invalid)"
        )
    if task_ids:
        wanted = set(task_ids)
        missing = wanted - set(seen)
        if missing:
            errors.append(
                RecordError(location, 0, None, f"--task-ids not in the dataset: {sorted(missing)}")
            )
        tasks = [t for t in tasks if t.id in wanted]
    if limit is not None:
        tasks = tasks[:limit]
    if unknown_fields:
        listing = ", ".join(f"{k!r} ({n} records)" for k, n in sorted(unknown_fields.items()))
        errors.append(RecordError(location, 0, None, f"unknown task fields ignored: {listing}"))
    return tasks, errors, location


def expand_samples(tasks: list[Task], n: int) -> list[Task]:
    """--samples N: N independent agents per task, ids `<task>#<k>` (N = 1: the tasks as
    they are, so a run folder of single samples keeps its ids)."""
    if n == 1:
        return tasks
    return [
        replace(t, id=f"{t.id}#{k}", sample=k, dataset_id=t.id) for t in tasks for k in range(n)
    ]
