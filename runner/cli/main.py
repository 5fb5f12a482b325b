"""Command line: `python run.py --tasks swe.jsonl [options]`.

Parse and check the options, make a plan (the tasks, the run folder, the engine, the batch
settings), then run it on the one batch path every engine shares (runner/batch/session.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.sandbox import CommandSandbox, Limits, SandboxUnavailable, limits_line, make_sandbox

from ..batch.batch import Batch, BatchConfig
from ..batch.progress import Progress
from ..batch.session import LoopRunner, execute
from ..engines.protocol import SamplingParams
from ..gate.ordering import describe as describe_order
from ..gate.ordering import longest_first, previous_lengths
from ..policies.protocol import Policy
from ..policies.registry import DEFAULT_POLICY, make_policy
from ..runfolder.store import RunFolderBusy, RunFolderWriteError, RunStore
from ..tasks.formats import parse_field_map
from ..tasks.tasks import KNOWN_FIELDS, RecordError, Task, expand_samples, load_tasks
from .checks import check_options, tool_names
from .config import differing, resolved, run_record, to_toml
from .config import parse_args as config_args
from .engines import (
    ENGINES,
    EngineSetup,
    check_sampling,
    constrain_tool_calls,
    native_preflight,
    sim_engine_options,
)
from .parser import AIMD_FLAGS, build_parser

log = logging.getLogger("concur")
OUTPUTS = Path(__file__).resolve().parent.parent.parent / "outputs"


@dataclass
class Plan:
    """What one invocation runs."""

    tasks: list[Task]
    bad: list[RecordError]  # invalid records (and the --task-ids complaint), for errors.jsonl
    source: str  # what the run folder belongs to
    out: Path
    config: BatchConfig
    sandbox: CommandSandbox | None = None  # None: the one --sandbox asks for
    setup: EngineSetup | None = None  # None: built from ENGINES once the run folder is ours
    run_loop: LoopRunner | None = None  # None: asyncio.run (wall clock)
    sha256: str | None = None  # the dataset file's content (None: hub or simulated)


def task_id(task: Task) -> str:
    return task.id


def report(argv: list[str]) -> int:
    from ..report.command import main as report_main

    return report_main(argv)


def export(argv: list[str]) -> int:
    from ..runfolder.export import main as export_main

    return export_main(argv)


def doctor(argv: list[str]) -> int:
    from .doctor import main as doctor_main

    return doctor_main(argv)


def policies(argv: list[str]) -> int:
    """`run.py policies`: every registered policy, its parameters with their defaults
    (<key>: required, [key]: derived from the others) and what it does."""
    from ..policies.registry import describe, registered

    if argv:
        print(f"run.py policies: takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    for cls in registered().values():
        kind = "experiment" if ".experimental." in cls.__module__ else "policy"
        # the docstring's first two lines: what it does (AIMD's second is its law)
        doc = [x.strip() for x in (cls.__doc__ or "").strip().splitlines() if x.strip()][:2]
        what = " ".join(doc) if doc and doc[0].endswith(":") else (doc[0] if doc else "")
        print(f"{describe(cls)}\n    {kind}, a slot per {cls.unit}: {what}")
    print("\nSet one with --policy NAME:key=value,... (docs/policies.md).")
    return 0


# `run.py NAME ...`: name -> function taking the rest of argv, returning an exit code
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "report": report,
    "export": export,
    "doctor": doctor,
    "policies": policies,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    args = config_args(build_parser(), argv)
    try:
        return _main(args)
    except RunFolderWriteError as e:  # before the batch (in it, the session reports it)
        print(f"run.py: error: {e}; free space and run again", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    try:
        check_options(args)
        policy = policy_from_args(args)
        plan, order_note = make_plan(args)
    except (ValueError, OSError) as e:  # TaskSourceError is a ValueError
        return fail(str(e))
    if not plan.tasks:
        return fail(nothing_to_run(plan))
    if args.eval_only and not (plan.out / "trajectories.jsonl").is_file():
        return fail(
            f"--eval-only: {plan.out} holds no trajectories.jsonl; pass the run folder (--out)"
        )
    if not args.eval_only and args.ray is None:
        problem = native_preflight(args)  # a native crash stops the run before it writes
        if problem:
            return fail(problem)
    fresh = not plan.out.exists()  # a refused start removes the run folder it made
    try:
        store = RunStore(plan.out)
        config = resolved(args)
        meta = store.bind_source(plan.source, run_record(config, Path(plan.source)), plan.sha256)
    except RunFolderBusy as e:
        return fail(str(e))
    problem = check_resume(meta, config, args.eval_only, plan.out)
    if problem:
        return fail(problem)
    setup_logging(store.log, args.quiet)
    report_bad_records(store, plan.bad)
    if order_note:  # a warning where no task was found: the order is the dataset's
        (log.info if order_note[0] else log.warning)("%s", order_note[1])
        if order_note[0] and not policy.wants_contexts:
            log.warning(
                "--order-from with --policy %s, which does not fit the agents' contexts to "
                "the pool: the long tasks first can overcommit it (measured: aimd 1.6-1.8x "
                "slower on a shared-prompt batch; docs/gate.md, Task order)",
                policy.name,
            )
    if args.ray is not None:  # a batch over many nodes: the workers build their own runners
        from .scaleout import run_on_ray

        todo = resume(args, plan, store)
        bad = sum(1 for err in plan.bad if err.line > 0)
        return run_on_ray(args, plan.tasks, todo, bad, plan.config, store, policy)
    try:
        sandbox = plan.sandbox or make_sandbox(args.sandbox)
    except SandboxUnavailable as e:
        discard_if_new(store, fresh)
        return fail(str(e))
    log.info("%s", limits_line(sandbox, plan.config.limits, plan.config.workspace_fs))
    if args.eval_only:
        return eval_only(plan.tasks, store, sandbox, plan.config)
    try:
        setup = plan.setup or ENGINES[args.engine](args, plan.tasks)
    except Exception as e:  # any failure to start is the user's to see, with its type
        discard_if_new(store, fresh)
        return fail(f"cannot start the engine: {type(e).__name__}: {e}")
    problem = sampling_problem(args, plan, setup)
    if problem:
        discard_if_new(store, fresh)
        return fail(problem)
    return run(args, plan, store, sandbox, setup, policy)


def sampling_problem(args: argparse.Namespace, plan: Plan, setup: EngineSetup) -> str:
    """Why the engine would refuse the run's sampling options ("" if it would not), checked
    once before any agent runs; the engine is closed when it would."""
    constrain = constrain_tool_calls(args.constrain_tool_calls, setup.engine)
    try:
        check_sampling(setup.engine, plan.config.sampling, plan.tasks, constrain)
    except ValueError as e:
        asyncio.run(setup.engine.aclose())
        return f"sampling options: {e}"
    return ""


def run(
    args: argparse.Namespace,
    plan: Plan,
    store: RunStore,
    sandbox: CommandSandbox,
    setup: EngineSetup,
    policy: Policy,
) -> int:
    resume(args, plan, store)
    plan.config.constrain_tool_calls = constrain_tool_calls(args.constrain_tool_calls, setup.engine)
    progress = Progress(interval=args.progress_interval)
    batch = Batch(plan.tasks, setup.engine, sandbox, policy, store, plan.config, progress)
    outcome = execute(
        batch,
        setup.engine,
        setup.why,
        task_ids=[t.id for t in plan.tasks],
        invalid_records=sum(1 for err in plan.bad if err.line > 0),  # not --task-ids'
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        run_loop=plan.run_loop,
        grace=args.grace_seconds,
    )
    s = outcome.summary
    log.info(
        "done in %.1fs%s: %s; solved %s/%s; hit rate %s; outputs in %s",
        s["wall_seconds"],
        f" ({s['batch_seconds']:,.1f} simulated s)" if s["clock"] == "virtual" else "",
        s["agents_by_status"],
        s["solved"],
        s["evaluated"],
        s["hit_rate"],
        plan.out,
    )
    return outcome.exit_code


def resume(args: argparse.Namespace, plan: Plan, store: RunStore) -> list[Task]:
    """What is left to run in the run folder (errors run again unless --keep-errors)."""
    if not args.keep_errors:  # only now: a failed start must not have dropped their records
        again = store.retry_errors({t.id for t in plan.tasks})
        if again:
            log.info(
                "%d tasks that ended in error run again (--keep-errors to skip them): %s",
                len(again),
                ", ".join(again[:20]) + (" ..." if len(again) > 20 else ""),
            )
    todo = [t for t in plan.tasks if t.id not in store.finished]
    log.info(
        "%d tasks from %s: %d already finished in %s, %d to run",
        len(plan.tasks),
        plan.source,
        len(plan.tasks) - len(todo),
        plan.out,
        len(todo),
    )
    return todo


# ---- options ------------------------------------------------------------------------------


def policy_from_args(args: argparse.Namespace) -> Policy:
    """The policy, and the options that default to it set in `args` (so that run.json
    records what ran): --policy itself, --pause-rule and --resume-rule."""
    options = {field: getattr(args, flag) for field, flag in AIMD_FLAGS.items()}
    if args.policy is None:
        given = [f"--{flag.replace('_', '-')}" for flag in AIMD_FLAGS.values()
                 if getattr(args, flag) is not None]  # fmt: skip
        if given:  # the paper's flags meant for the paper's law, not the default's fallback
            raise ValueError(
                f"{', '.join(given)}: AIMD's parameters; the default policy is "
                f"{DEFAULT_POLICY}: pass --policy aimd for the paper's law (or --policy "
                f"{DEFAULT_POLICY} to set the AIMD it falls back on without a pool size)"
            )
        args.policy = DEFAULT_POLICY
    try:
        policy = make_policy(args.policy, **options)
    except ValueError as e:
        raise ValueError(f"--policy {args.policy}: {e}") from None
    pause, resume = policy.rules
    args.pause_rule = args.pause_rule or pause
    args.resume_rule = args.resume_rule or resume
    return policy


# ---- plans --------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> tuple[Plan, tuple[bool, str] | None]:
    """The plan, its tasks in the order --order-from gives, and the line saying where that
    order came from (with whether any task was found there)."""
    # read first: a simulated plan replaces its run folder, which may be the one named
    lengths = previous_lengths(args.order_from) if args.order_from else None
    plan = simulation_plan(args) if args.engine == "sim" else dataset_plan(args)
    if lengths is None:
        return plan, None
    found, line = describe_order(lengths, plan.tasks, task_id)
    plan.tasks = longest_first(plan.tasks, lengths.seconds, task_id)
    return plan, (found > 0, line)


def dataset_plan(args: argparse.Namespace) -> Plan:
    if not args.tasks:
        raise ValueError("--tasks is required (a dataset file or a Hugging Face dataset name)")
    ids = [t.strip() for t in args.task_ids.split(",")] if args.task_ids else None
    fmap = parse_field_map(args.field_map, KNOWN_FIELDS) if args.field_map else None
    tasks, bad, source = load_tasks(args.tasks, args.limit, ids, args.split, fmap)
    tasks = expand_samples(tasks, args.samples)
    local = Path(source).exists()  # a file or a save_to_disk folder
    sha256 = None
    if local:  # one dataset however its path was typed (run.json keeps both)
        source = str(Path(source).resolve())
        if Path(source).is_file():
            sha256 = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    out = args.out or OUTPUTS / (Path(source).stem if local else source.replace("/", "_"))
    config = BatchConfig(
        max_steps=args.max_steps or BatchConfig.max_steps,
        max_steps_cap=args.max_steps,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        ),
        tools=tool_names(args),
        control_period=args.control_period,
        pause_rule=args.pause_rule,
        resume_rule=args.resume_rule,
        keep_workspaces=(out / "workspaces") if args.keep_workspaces else None,
        workspace_root=workspace_root(out),
        limits=Limits(timeout_s=args.tool_timeout),
        workspace_fs=args.workspace_fs,
        eval_timeout=args.eval_timeout,
        rollouts=not args.no_rollouts,
    )
    return Plan(tasks, bad, source, out, config, sha256=sha256)


def nothing_to_run(plan: Plan) -> str:
    """The message for a dataset (or selection) without one valid task, with the counts."""
    invalid = [e for e in plan.bad if e.line > 0]
    msg = f"no task to run from {plan.source}: 0 valid, {len(invalid)} invalid records"
    notes = [e for e in plan.bad if e.line == 0]  # --task-ids not found, unknown fields
    for e in invalid[:5]:
        msg += f"\n  line {e.line}: {e.reason}"
    if len(invalid) > 5:
        msg += f"\n  ... and {len(invalid) - 5} more"
    for e in notes:
        msg += f"\n  {e.reason}"
    return msg


def simulation_plan(args: argparse.Namespace) -> Plan:
    """--engine sim: the tasks come from --workload and run on virtual time against the
    simulated engine with the simulated tools. A simulated run starts afresh (its folder is
    replaced): resuming a run on a clock of its own would measure nothing."""
    from ..sim.simulate import load_workload, sim_config, sim_parts
    from ..sim.tools import NullSandbox
    from ..sim.vclock import run_virtual

    if args.eval_only:
        raise ValueError("--eval-only does not apply to --engine sim")
    workload = load_workload(args.workload, args.workload_seed)
    parts = sim_parts(workload, args.sim_deployment, sim_engine_options(args))
    out = args.out or OUTPUTS / f"sim-{workload.name}-{args.sim_deployment}"
    if out.exists():
        shutil.rmtree(out)
    config = sim_config(
        parts,
        control_period=args.control_period,
        pause_rule=args.pause_rule,
        resume_rule=args.resume_rule,
    )
    setup = EngineSetup(parts.engine, f"chosen with --engine sim ({args.sim_deployment})")
    source = f"sim:{workload.name}:{args.workload_seed}"
    return Plan(parts.tasks, [], source, out, config, NullSandbox(), setup, run_virtual)


# ---- run folder and logging ---------------------------------------------------------------


def check_resume(meta: dict[str, Any], config: dict[str, Any], eval_only: bool, out: Path) -> str:
    """Why this run may not go on in `out` ("" if it may); writes run.toml on a first run."""
    recorded = meta.get("config")
    if not isinstance(recorded, dict):  # a run folder of a version that recorded none
        return ""
    if not (out / "run.toml").exists():
        (out / "run.toml").write_text(to_toml(recorded), encoding="utf-8")
    keys = [] if eval_only else [k for k in differing(recorded, config) if k != "tasks"]
    if not keys:
        return ""
    changes = ", ".join(f"--{k.replace('_', '-')} ({recorded.get(k)!r} -> {config.get(k)!r})"
                        for k in keys)  # fmt: skip
    return (
        f"{out} holds a run made with other options that change results: {changes}. Resume "
        f"it with its own options (--config {out / 'run.toml'}) or pass another --out"
    )


def workspace_root(out: Path) -> Path:
    """The live-workspace folder of a run folder: fixed, so a rerun clears a killed run's."""
    digest = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"concur-ws-{digest}"


def report_bad_records(store: RunStore, bad: list[RecordError]) -> None:
    known = 0
    for err in bad:
        if not store.add_error_once(err.to_json()):  # recorded by an earlier run already
            known += 1
            continue
        if err.line > 0:
            log.warning("skipping task record %s:%d: %s", err.source, err.line, err.reason)
        else:
            log.warning("%s: %s", err.source, err.reason)
    if known:
        log.warning("%d dataset problems, as reported before (see %s)", known, store.errors)
    if store.repaired_bytes:
        log.warning(
            "repaired a torn last line (%d bytes) left by an interrupted run", store.repaired_bytes
        )


class _RunLogHandler(logging.FileHandler):
    """run.log; a failed write (disk full) is said once on stderr, not as a traceback per
    line ("--- Logging error ---"): the run folder's own write error stops the batch."""

    _failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self._failed:
            self._failed = True
            e = sys.exc_info()[1]
            print(f"run.py: cannot write {self.baseFilename}: {e}", file=sys.stderr)


def setup_logging(path: Path, quiet: bool) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    root = logging.getLogger("concur")
    root.setLevel(logging.INFO)
    root.handlers.clear()
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING if quiet else logging.INFO)
    err.setFormatter(fmt)
    f = _RunLogHandler(path, encoding="utf-8")
    f.setFormatter(fmt)
    root.addHandler(err)
    root.addHandler(f)


def discard_if_new(store: RunStore, fresh: bool) -> None:
    """A start refused before any agent ran leaves no run folder it made itself."""
    if not fresh:
        return
    for h in logging.getLogger("concur").handlers[:]:
        if isinstance(h, logging.FileHandler):  # run.log is in the folder
            logging.getLogger("concur").removeHandler(h)
            h.close()
    shutil.rmtree(store.root, ignore_errors=True)


def fail(msg: str) -> int:
    print(f"run.py: error: {msg}", file=sys.stderr)
    return 2


def eval_only(
    tasks: list[Task], store: RunStore, sandbox: CommandSandbox, config: BatchConfig
) -> int:
    from ..batch.rescore import RescoreError, rescore

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
