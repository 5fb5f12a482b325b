"""Reading other people's datasets: `--field-map` (record fields to task fields), folders
written by `datasets`' `save_to_disk`, and CSV files whose errors name file lines."""

from __future__ import annotations

import csv
import io
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BadRecord:
    """A record that could not even be read (bad JSON, a malformed CSV row): its reason."""

    reason: str


class FieldMapError(ValueError):
    """A --field-map that cannot be parsed, or that names an unknown task field."""


class MissingField(ValueError):
    """A record lacks a field the field map reads."""

    def __init__(self, task_field: str, record_field: str) -> None:
        super().__init__(
            f"--field-map {task_field}={record_field}: the record has no field {record_field!r}"
        )
        self.record_field = record_field


def parse_field_map(text: str, task_fields: Iterable[str]) -> dict[str, str]:
    """'id=instance_id,prompt=problem_statement' -> {task field: record field}."""
    known = set(task_fields)
    out: dict[str, str] = {}
    for item in text.split(","):
        task_field, eq, record_field = (x.strip() for x in item.partition("="))
        if not eq or not task_field or not record_field:
            raise FieldMapError(
                f"bad item {item.strip()!r}: write TASK_FIELD=RECORD_FIELD,... "
                "(id=instance_id,prompt=problem_statement)"
            )
        if task_field not in known:
            raise FieldMapError(
                f"{task_field!r} is not a task field; task fields: {', '.join(sorted(known))}"
            )
        if task_field in out:
            raise FieldMapError(f"task field {task_field!r} is mapped twice")
        out[task_field] = record_field
    return out


def apply_field_map(rec: Any, fmap: dict[str, str]) -> Any:
    """The record with each mapped record field under its task field (the record field
    itself removed, so it is not reported as unknown). MissingField if one is absent."""
    if not fmap or not isinstance(rec, dict):
        return rec
    for task_field, record_field in fmap.items():
        if record_field not in rec:
            raise MissingField(task_field, record_field)
    out = {k: v for k, v in rec.items() if k not in fmap.values()}
    out.update({task_field: rec[record_field] for task_field, record_field in fmap.items()})
    return out


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def read_saved_dataset(path: Path, split: str) -> list[Any]:
    """The rows of a save_to_disk folder (a DatasetDict: its `split`). ValueError naming the
    folder when it cannot be read or has no such split."""
    import datasets  # slow import: only when needed

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # the library raises many types; all mean "cannot read it"
        raise ValueError(
            f"cannot load tasks from the saved dataset {path}: {type(e).__name__}: {e}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(
                f"{path}: no split {split!r} in this saved DatasetDict; it has "
                f"{', '.join(ds)} (--split)"
            )
        ds = ds[split]
    return list(ds)


def decode_whole(location: str) -> str:
    """The file as text, or ValueError naming the line of the first byte that is not
    UTF-8 (a CSV record can span lines, so one bad byte cannot cost just one record)."""
    data = Path(location).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{location}:{line}: not UTF-8 (byte 0x{data[e.start]:02x}); convert the file "
            "to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_csv(location: str) -> tuple[list[dict[str, Any] | BadRecord], list[int]]:
    """-> (records, the file line each record starts on). Every cell as the text it is (a
    type-inferring reader turns an `eval` of "true" into a bool and an id of "007" into 7);
    empty cells mean "not given". A row with more cells than the header is a record of
    its own error; a file the csv module cannot parse is a ValueError naming the line."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # `files` cells can be large
    records: list[dict[str, Any] | BadRecord] = []
    lines: list[int] = []
    with io.StringIO(decode_whole(location), newline="") as f:
        reader = csv.DictReader(f)
        try:
            columns = len(reader.fieldnames or ())  # reads the header
            start = reader.line_num + 1
            for row in reader:
                lines.append(start)
                extra = row.get(None)
                if extra:
                    records.append(
                        BadRecord(f"{len(extra)} more cells than the header's {columns} columns")
                    )
                else:
                    records.append(
                        {k: v for k, v in row.items() if isinstance(k, str) and v not in ("", None)}
                    )
                start = reader.line_num + 1
        except csv.Error as e:
            raise ValueError(f"{location}:{reader.line_num}: bad CSV: {e}") from None
    return records, lines


ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


def source_kind(path: Path) -> str | None:
    """ "dir", "tar", "zip", or None when the path is neither a directory nor an archive."""
    if path.is_dir():
        return "dir"
    name = path.name.lower()
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return "tar"
    return None
