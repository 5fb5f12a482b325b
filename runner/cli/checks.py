"""Option values checked right after parsing, one function per option group of the parser
(runner/cli/parser.py), so a bad value is one clear line, never a traceback or a batch that
turns every agent into an error record. Each raises ValueError naming the option."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from tools.registry import REGISTRY as TOOL_REGISTRY

# Progress lines more often than this only flood the log (0 wrote 11 MB in 7 s).
MIN_PROGRESS_INTERVAL = 0.5


def _at_least(args: argparse.Namespace, flag: str, low: float, strict: bool = False) -> None:
    value = getattr(args, flag.removeprefix("--").replace("-", "_"))
    if value is None:
        return
    if value != value or (value <= low if strict else value < low):  # NaN fails too
        raise ValueError(f"{flag} must be {'>' if strict else '>='} {low:g}, got {value}")


def check_task_options(args: argparse.Namespace) -> None:
    _at_least(args, "--max-steps", 1)
    _at_least(args, "--limit", 0)
    _at_least(args, "--samples", 1)
    if args.task_ids is not None and not [t for t in args.task_ids.split(",") if t.strip()]:
        raise ValueError("--task-ids names no task id")
    if args.out is not None:
        check_out(args.out)


def check_out(out: Path) -> None:
    """The run folder: a directory, or a path one can create as one, writable by us."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory; pass a folder")
    here = out
    while not here.exists():  # the nearest ancestor that exists is where it gets created
        if here.parent == here:
            break
        here = here.parent
    if not here.is_dir():
        raise ValueError(f"--out {out}: {here} is not a directory")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {here} is not writable by this user; pass another --out")


def check_engine_options(args: argparse.Namespace) -> None:
    _at_least(args, "--n-ctx", 1)
    _at_least(args, "--pool-tokens", 64)
    _at_least(args, "--max-seqs", 1)
    _at_least(args, "--prefill-chunk", 16)
    _at_least(args, "--threads", 1)
    _at_least(args, "--max-new-tokens", 1)
    _at_least(args, "--temperature", 0)
    _at_least(args, "--top-p", 0, strict=True)
    if args.top_p > 1:
        raise ValueError(f"--top-p must be <= 1, got {args.top_p}")
    if args.replay_from and args.engine != "replay":
        raise ValueError("--replay-from needs --engine replay")
    check_sampling_args(args)


def check_sampling_args(args: argparse.Namespace) -> None:
    """--sampling-arg: KEY=VALUE items, for an engine that samples. Whether the engine takes
    each key and value is its own check, once it is up (SamplingCheck)."""
    if not args.sampling_arg:
        return
    if args.engine in ("replay", "sim"):
        raise ValueError(f"--sampling-arg: --engine {args.engine} samples nothing; drop it")
    from ..engines.sglang.args import parse_engine_args

    parse_engine_args(args.sampling_arg, flag="--sampling-arg")


def check_simulation_options(args: argparse.Namespace) -> None:
    _at_least(args, "--hicache-ratio", 0)


def check_gate_options(args: argparse.Namespace) -> None:
    _at_least(args, "--control-period", 0, strict=True)
    _at_least(args, "--initial-window", 1)


def check_sandbox_options(args: argparse.Namespace) -> None:
    _at_least(args, "--tool-timeout", 0, strict=True)
    _at_least(args, "--eval-timeout", 0, strict=True)
    unknown = [t for t in tool_names(args) if t not in TOOL_REGISTRY]
    if unknown:
        raise ValueError(f"--tools: unknown {unknown}; available: {sorted(TOOL_REGISTRY)}")
    if not tool_names(args):
        raise ValueError(f"--tools names no tool; available: {sorted(TOOL_REGISTRY)}")


def check_stopping_options(args: argparse.Namespace) -> None:
    _at_least(args, "--grace-seconds", 0)


def check_display_options(args: argparse.Namespace) -> None:
    _at_least(args, "--progress-interval", MIN_PROGRESS_INTERVAL)


def check_scaleout_options(args: argparse.Namespace) -> None:
    if args.ray is not None or args.workers is not None:
        from .scaleout import check_ray_options

        check_ray_options(args)


def tool_names(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(t.strip() for t in args.tools.split(",") if t.strip())


CHECKS: tuple[Callable[[argparse.Namespace], None], ...] = (
    check_task_options,
    check_engine_options,
    check_simulation_options,
    check_gate_options,
    check_sandbox_options,
    check_stopping_options,
    check_display_options,
    check_scaleout_options,
)


def check_options(args: argparse.Namespace) -> None:
    for check in CHECKS:
        check(args)
