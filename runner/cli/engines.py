"""The engine factory table: `--engine NAME` -> how to build that engine from the options.

Each entry builds an engine from the parsed options and the tasks, and says why it was
chosen (summary.json keeps the reason). Heavy engines are imported only when chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..batch.batch import sampling_for
from ..engines.protocol import ConstrainedDecoding, Engine, SamplingCheck, SamplingParams
from ..tasks.tasks import Task

log = logging.getLogger("concur")


@dataclass
class EngineSetup:
    engine: Engine
    why: str


def _llama_cpp(args: argparse.Namespace, why: str) -> EngineSetup:
    from ..engines.llama_cpp import LlamaCppEngine
    from ..engines.sglang.args import parse_engine_args

    engine = LlamaCppEngine(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        pool_tokens=args.pool_tokens,
        max_seqs=args.max_seqs,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
        sampling_extra=parse_engine_args(args.sampling_arg, flag="--sampling-arg"),
    )
    log.info(
        "llama.cpp engine: %s, pool %d tokens (%.0f MiB of KV), %d sequences of %d tokens "
        "(%.0f MiB allocated), prefill chunk %d, %d threads; %s",
        engine.model, engine.pool.capacity, engine.pool_bytes / 2**20, engine.max_seqs,
        engine.pool.slot_cells, engine.kv_bytes / 2**20, engine.chunk, engine.threads,
        engine.load.why,
    )  # fmt: skip
    return EngineSetup(engine, why)


def uses_llama_cpp(args: argparse.Namespace) -> bool:
    """Whether ENGINES[args.engine] will build the llama.cpp engine (auto's rule)."""
    if args.engine == "llama.cpp":
        return True
    if args.engine != "auto":
        return False
    from ..engines.sglang import sglang_available

    ok, _ = sglang_available()
    return not (ok and args.model and not args.model.endswith(".gguf"))


def native_preflight(args: argparse.Namespace) -> str:
    """The start-up self-check of the native engine (a tiny decode in a child process),
    before anything is written: "" if it passed or does not apply, else the message."""
    if not uses_llama_cpp(args):
        return ""
    from pathlib import Path

    from ..engines.llama_cpp.native import default_model_path
    from ..engines.llama_cpp.selfcheck import NativeEngineCrash, run_selfcheck

    try:
        model = Path(args.model) if args.model else default_model_path()
    except FileNotFoundError as e:
        return str(e)
    if not model.is_file():
        return f"model file not found: {model}"
    import os

    try:
        check = run_selfcheck(model, args.threads or max(1, os.cpu_count() or 1))
    except NativeEngineCrash as e:
        return str(e)
    log.debug("llama.cpp self-check passed%s", " (remembered)" if check.cached else "")
    return ""


def _sglang(args: argparse.Namespace, why: str) -> EngineSetup:
    from ..engines.sglang import sglang_engine_from_args

    return EngineSetup(sglang_engine_from_args(args), why)


def auto(args: argparse.Namespace, tasks: list[Task]) -> EngineSetup:
    """SGLang where it imports, a CUDA GPU is visible and --model is not a GGUF file;
    otherwise the embedded llama.cpp CPU engine."""
    from ..engines.sglang import sglang_available

    ok, reason = sglang_available()
    if ok and args.model and not args.model.endswith(".gguf"):
        return _sglang(args, f"auto: {reason}")
    if ok:
        return _llama_cpp(args, f"auto: {reason}, but --model is a GGUF file (or unset): llama.cpp")
    return _llama_cpp(args, f"auto: {reason}; using the embedded llama.cpp CPU engine")


def llama_cpp(args: argparse.Namespace, tasks: list[Task]) -> EngineSetup:
    return _llama_cpp(args, "chosen with --engine llama.cpp")


def sglang(args: argparse.Namespace, tasks: list[Task]) -> EngineSetup:
    return _sglang(args, "chosen with --engine sglang")


def replay(args: argparse.Namespace, tasks: list[Task]) -> EngineSetup:
    from ..engines.replay import replay_engine_from_args

    return EngineSetup(replay_engine_from_args(args, tasks), "chosen with --engine replay")


# `sim` is built with its tasks (they come from --workload): see runner/cli/main.py.
ENGINES: dict[str, Callable[[argparse.Namespace, list[Task]], EngineSetup]] = {
    "auto": auto,
    "llama.cpp": llama_cpp,
    "sglang": sglang,
    "replay": replay,
}
ENGINE_NAMES = (*ENGINES, "sim")


def sim_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """--engine sim: the simulated engine's options from the command line (bench/paper.py's
    `cli_args` writes the same options for each of its runs)."""
    options: dict[str, Any] = {}
    cap = args.sim_max_total_tokens
    if cap is not None:
        if cap < 1:
            raise ValueError(f"--sim-max-total-tokens must be >= 1, got {cap}")
        options["max_total_tokens"] = cap
    if args.sim_pool_scale != 1.0:
        if not args.sim_pool_scale > 0:
            raise ValueError(f"--sim-pool-scale must be > 0, got {args.sim_pool_scale}")
        options["pool_scale"] = args.sim_pool_scale
    if args.hicache_ratio > 0:
        options["hicache_ratio"] = args.hicache_ratio
    if args.hicache_size > 0:
        options["hicache_size"] = args.hicache_size
    if args.hicache_gbps is not None:
        if args.hicache_gbps <= 0:
            raise ValueError(f"--hicache-gbps must be > 0, got {args.hicache_gbps}")
        options["pcie_bytes_per_s"] = args.hicache_gbps * 1e9
    if args.sglang_sessions:  # the simulator models SGLang's session radix cache too
        options["sessions"] = True
    return options


def constrain_tool_calls(choice: str, engine: Engine) -> bool:
    """--constrain-tool-calls on|off|auto for this engine (auto: the engine's own default)."""
    can = isinstance(engine, ConstrainedDecoding)
    if choice == "on" and not can:
        log.warning("--constrain-tool-calls: %s cannot constrain decoding; ignored", engine.name)
    if not isinstance(engine, ConstrainedDecoding):
        return False
    return choice == "on" or (choice == "auto" and engine.constrain_by_default)


# A schema for the check only: what matters is that a constrained request carries one.
_ANY_CALL_SCHEMA = '{"type": "object"}'


def check_sampling(
    engine: Engine, base: SamplingParams, tasks: list[Task], constrain: bool
) -> None:
    """At start-up, before any agent runs: the run's sampling and each task's own overrides
    (each distinct set once), through the engine's own check (SamplingCheck), as its
    requests will carry them. ValueError naming the option (and the task, for a task's)."""
    if not isinstance(engine, SamplingCheck):
        return
    schema = _ANY_CALL_SCHEMA if constrain else None
    seen: set[SamplingParams] = set()
    for task in [None, *tasks]:
        sp = base if task is None else sampling_for(base, task)
        sp = dataclasses.replace(sp, seed=0, tool_call_schema=schema)
        if sp in seen:
            continue
        seen.add(sp)
        try:
            engine.check_sampling(sp)
        except ValueError as e:
            where = "" if task is None else f"task {task.id} (its sampling {task.sampling}): "
            raise ValueError(f"{where}{e}") from None
