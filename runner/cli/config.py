"""Config files and the run record.

`--config run.toml` sets any option by its long name (`max_steps = 4` or `max-steps = 4`);
flags given on the command line win. Unknown keys and values of the wrong type or outside
an option's choices are errors naming the key and the file.

A run folder's run.json (written once by `RunStore.bind_source`, never rewritten) records the
resolved config, the package versions, the code's git commit and a hash of the dataset; the
resolved config is also written as run.toml, loadable with `--config`. Resuming a run folder
with options that would change its results is refused, naming the keys that differ.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import subprocess
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
# Options that change what is shown or which tasks run, not any task's result: they may
# differ when a run folder is resumed.
NOT_RESULTS = frozenset(
    {
        "config",
        "out",
        "progress_interval",
        "quiet",
        "limit",
        "task_ids",
        "keep_errors",
        "keep_workspaces",  # where finished workspaces go, not what happens in them
        "workspace_fs",  # how the same size limit is enforced
        "eval_only",
        "threads",
        "order_from",  # which task starts first, not what any does
    }
)
PACKAGES = ("concur-runner", "llama-cpp-python", "sglang", "torch", "datasets", "matplotlib")


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv over the defaults a `--config FILE` in it sets."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        parser.set_defaults(**load_config(parser, known.config))
    return parser.parse_args(argv)


def load_config(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        parser.error(f"--config {path}: cannot read it: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        parser.error(f"--config {path}: not TOML: {e}")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None or dest == "config":
            parser.error(f"{path}: unknown key {key!r} (options: {', '.join(sorted(actions))})")
        try:
            values[dest] = convert(action, value)
        except (TypeError, ValueError) as e:
            parser.error(f"{path}: key {key!r}: {e}")
    return values


def convert(action: argparse.Action, value: Any) -> Any:
    """A TOML value for one option, checked as the command line would check it."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):  # repeatable (--engine-arg K=V ...)
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {value!r}")
        return [_one(action, v) for v in value]
    return _one(action, value)


def _one(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool | list | dict):
        raise TypeError(f"expected a single value, got {value!r}")
    kind = action.type
    if kind is int and not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    if kind is float and not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    if kind in (None, Path) and not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    out = kind(value) if callable(kind) else value
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def resolved(args: argparse.Namespace) -> dict[str, Any]:
    """Every option's value (None: not set), as strings where they are paths."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}


def to_toml(config: dict[str, Any]) -> str:
    """The options that are set, as a TOML file `--config` reads back."""
    lines = ["# the resolved options of this run (python run.py --config run.toml ...)"]
    for k, v in config.items():
        if v is None or k == "config":
            continue  # TOML has no null: an unset option is left out
        lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


def run_record(config: dict[str, Any], tasks_path: Path | None) -> dict[str, Any]:
    return {
        "config": config,
        "packages": package_versions(),
        "git_commit": git_commit(),
        "dataset_hash": file_hash(tasks_path) if tasks_path and tasks_path.is_file() else None,
    }


def differing(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Options whose values differ and that change results."""
    keys = (recorded.keys() | now.keys()) - NOT_RESULTS
    return sorted(k for k in keys if recorded.get(k) != now.get(k))


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def git_commit() -> str | None:
    """The code's commit (+"-dirty" with uncommitted changes), None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
