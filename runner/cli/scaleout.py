"""`--ray [ADDRESS]` and `--workers N`: the command line's side of a batch over many nodes
(runner/scaleout/). It checks the options and builds each worker's spec: the engine and
sandbox factories the worker calls on its own node, its uid range, its workspace folder."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from tools.sandbox import AGENT_UID_BASE, CommandSandbox, make_sandbox

from ..batch.batch import BatchConfig
from ..batch.progress import Progress
from ..engines.protocol import SamplingParams
from ..policies.protocol import Policy
from ..runfolder.store import RunStore
from ..scaleout.protocol import EngineBuild, WorkerSpec, worker_uid_base
from ..tasks.tasks import Task
from .engines import ENGINES, check_sampling, constrain_tool_calls, sim_engine_options

log = logging.getLogger("concur")


def check_ray_options(args: argparse.Namespace) -> None:
    if args.ray is None:
        raise ValueError("--workers needs --ray (a batch over the nodes of a Ray cluster)")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    for flag, on in (("--eval-only", args.eval_only), ("--keep-workspaces", args.keep_workspaces)):
        if on:  # workspaces live on the workers' nodes, not beside the run folder
            raise ValueError(f"{flag} does not apply to --ray: run it without --ray")


def run_on_ray(
    args: argparse.Namespace,
    tasks: list[Task],
    todo: list[Task],
    invalid_records: int,
    config: BatchConfig,
    store: RunStore,
    policy: Policy,
) -> int:
    from ..scaleout.driver import RayUnavailable, run

    make_spec = spec_maker(args, tasks, config, policy)
    try:
        outcome = run(
            address=args.ray or None,
            store=store,
            tasks=todo,
            make_spec=make_spec,
            workers=args.workers,
            gpus_per_worker=gpus_per_worker(args),
            progress=Progress(interval=args.progress_interval),
            task_ids=[t.id for t in tasks],
            invalid_records=invalid_records,
            config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        )
    except RayUnavailable as e:
        print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        log.error("%s", e)
        return 2
    s = outcome.summary
    log.info(
        "done in %.1fs on %d workers (%d lost, %d tasks put back): %s; solved %s/%s; outputs in %s",
        s["wall_seconds"],
        s["scaleout"]["workers"],
        s["scaleout"]["workers_lost"],
        s["scaleout"]["tasks_put_back"],
        s["agents_by_status"],
        s["solved"],
        s["evaluated"],
        store.root,
    )
    return outcome.exit_code


def gpus_per_worker(args: argparse.Namespace) -> int:
    """GPUs each worker reserves: tp x dp for SGLang (auto picks SGLang for a non-GGUF
    model where a GPU is visible, so it reserves them too), none otherwise."""
    gguf = not args.model or args.model.endswith(".gguf")
    if args.engine == "sglang" or (args.engine == "auto" and not gguf):
        return (args.tp_size or 1) * (args.dp_size or 1)
    return 0


def spec_maker(
    args: argparse.Namespace, tasks: list[Task], config: BatchConfig, policy: Policy
) -> Callable[[int], WorkerSpec]:
    """Worker index -> its spec (what the driver sends each worker)."""
    checked = sampling_tasks(tasks)
    return functools.partial(worker_spec, args, config, policy, AGENT_UID_BASE, checked)


def sampling_tasks(tasks: list[Task]) -> list[Task]:
    """One task per distinct set of sampling overrides, carrying only its id and them: what
    each worker's engine checks at start-up (`build_engine`), small enough to send to every
    worker."""
    seen: dict[str, Task] = {}
    for t in tasks:
        if t.sampling:
            seen.setdefault(repr(sorted(t.sampling.items())), Task(t.id, [], sampling=t.sampling))
    return list(seen.values())


def worker_spec(
    args: argparse.Namespace,
    config: BatchConfig,
    policy: Policy,
    run_uid_base: int,
    checked: list[Task],
    index: int,
) -> WorkerSpec:
    root = config.workspace_root
    own = dataclasses.replace(
        config,
        uid_base=worker_uid_base(run_uid_base, index),
        workspace_root=Path(f"{root}-w{index}") if root is not None else None,
    )
    sim = args.engine == "sim"
    return WorkerSpec(
        index=index,
        config=own,
        policy=policy,
        make_engine=functools.partial(build_engine, args, config.sampling, checked),
        make_sandbox=null_sandbox if sim else functools.partial(make_sandbox, args.sandbox),
        run_loop=run_virtual if sim else None,
        virtual_time=sim,
    )


def build_engine(
    args: argparse.Namespace, sampling: SamplingParams, checked: list[Task]
) -> EngineBuild:
    """On the worker's node: its engine, as the single-process CLI would build it (the tasks
    come later; a replay engine learns their scripts as they arrive), with the run's
    sampling and the tasks' own overrides (`checked`: each distinct set once) checked by it
    before any agent, as the single-process CLI checks them (a refusal: this worker cannot
    start, the task named)."""
    if args.engine == "sim":
        from ..sim.simulate import load_workload, sim_parts

        workload = load_workload(args.workload, args.workload_seed)
        engine = sim_parts(workload, args.sim_deployment, sim_engine_options(args)).engine
        return EngineBuild(engine, f"chosen with --engine sim ({args.sim_deployment})")
    setup = ENGINES[args.engine](args, [])
    constrain = constrain_tool_calls(args.constrain_tool_calls, setup.engine)
    try:
        check_sampling(setup.engine, sampling, checked, constrain)
    except ValueError:
        asyncio.run(setup.engine.aclose())
        raise
    return EngineBuild(setup.engine, setup.why, constrain)


def null_sandbox() -> CommandSandbox:
    from ..sim.tools import NullSandbox

    return NullSandbox()


def run_virtual(coro: Coroutine[Any, Any, None]) -> None:
    from ..sim.vclock import run_virtual as run

    run(coro)
