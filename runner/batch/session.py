"""One batch session, the same for every engine: run the batch on its clock (wall-clock, or
virtual time for the simulator), close the engine, write summary.json whatever happened.

The CLI (runner/cli/) and the simulator's `simulate` (runner/sim/simulate.py) both end here,
so every run folder has one summary schema (runner/runfolder/summary.py).
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.sandbox import limits_in_force

from ..agent.stopping import DEFAULT_GRACE_SECONDS, SignalStop
from ..engines.protocol import Engine, EngineStats
from ..runfolder.store import RunFolderWriteError, RunStore
from ..runfolder.summary import batch_totals
from .batch import Batch, EngineDead

log = logging.getLogger("concur")

# asyncio.run, or the simulator's virtual-time equivalent
LoopRunner = Callable[[Coroutine[Any, Any, float]], float]


@dataclass
class Outcome:
    summary: dict[str, Any]
    exit_code: int  # 0 done, 1 the engine died, 128+N stopped by signal N (130 SIGINT, 143 SIGTERM)


def execute(
    batch: Batch,
    engine: Engine,
    why: str,
    *,
    task_ids: list[str],
    invalid_records: int,
    config: dict[str, Any],
    run_loop: LoopRunner | None = None,
    grace: float = DEFAULT_GRACE_SECONDS,
) -> Outcome:
    """Run `batch` to its end (or interruption) and write its summary. Re-raises what no
    record can describe (a crash of the runner itself) after the summary is written."""
    virtual = run_loop is not None
    runner: LoopRunner = run_loop or asyncio.run
    wall0 = time.monotonic()
    batch_seconds = 0.0
    interrupted, code = False, 0
    # Wall-clock runs stop on SIGINT/SIGTERM with a drain; a virtual-time run has no grace
    # period to give, so it keeps asyncio's own SIGINT handling (KeyboardInterrupt).
    stop = None if virtual else SignalStop(grace)
    try:
        batch_seconds = runner(_run(batch, engine, stop))
        if stop is not None and stop.received is not None:
            interrupted, code = True, stop.exit_code
            log.warning(
                "stopped by %s%s: finished agents are saved; run the same command to resume",
                stop.received.name,
                " before the agents in flight could finish" if stop.hard else "",
            )
    except KeyboardInterrupt:
        interrupted, code = True, 130
        log.warning("interrupted: finished agents are saved; run the same command to resume")
    except EngineDead as e:
        interrupted, code = True, 1
        log.error(
            "%s: the batch stopped. Finished agents are saved; the agents in flight and those "
            "that failed on the engine run again when you rerun the command",
            e,
        )
    except RunFolderWriteError as e:
        interrupted, code = True, 1
        log.error(
            "%s. The batch stopped: every record reported written is on disk; free space "
            "and run the same command to resume",
            e,
        )
    except BaseException:
        interrupted = True
        log.exception("the batch crashed; finished agents are saved; run again to resume")
        raise
    finally:
        wall = time.monotonic() - wall0
        summary = build_summary(
            batch,
            engine,
            why,
            task_ids=task_ids,
            invalid_records=invalid_records,
            wall_seconds=wall,
            batch_seconds=batch_seconds if virtual else wall,
            virtual_time=virtual,
            interrupted=interrupted,
            config=config,
        )
        if stop is not None and stop.received is not None:
            summary["stopped_by"] = stop.received.name
        summary["engine_retries"] = batch.totals.retries
        store = batch.store
        assert isinstance(store, RunStore), "a session's batch writes to a run folder"
        if _write_summary(store, summary):
            plot_timeline(store.root)
    return Outcome(summary, code)


def _write_summary(store: RunStore, summary: dict[str, Any]) -> bool:
    try:
        store.write_summary(summary)
        return True
    except RunFolderWriteError as e:  # the records are the truth; the summary is a view
        log.error("%s: no summary.json this time (the next run writes it)", e)
        return False


def plot_timeline(root: Path) -> None:
    """timeline.png beside the summary; a plot that fails is logged, never the run's end."""
    from ..report.timeline import write_timeline  # matplotlib only once a batch ends

    try:
        write_timeline(root)
    except Exception as e:
        log.warning("could not draw %s: %s: %s", root / "timeline.png", type(e).__name__, e)


async def _run(batch: Batch, engine: Engine, stop: SignalStop | None) -> float:
    """-> seconds of loop time the batch took. With `stop`, SIGINT and SIGTERM drain the
    batch (runner/agent/stopping.py) instead of ending the process."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    main = asyncio.current_task()
    assert main is not None
    if stop is not None:
        stop.install(loop, batch.stop_admitting, main.cancel)
    try:
        await batch.run()  # ends every tool process before returning
    except asyncio.CancelledError:
        if stop is None or not stop.hard:
            raise
        main.uncancel()  # our own stop: the batch has torn down; report it
    finally:
        try:
            await engine.aclose()
        finally:
            if stop is not None:
                stop.uninstall(loop)
    return loop.time() - t0


def build_summary(
    batch: Batch,
    engine: Engine,
    why: str,
    *,
    task_ids: list[str],
    invalid_records: int,
    wall_seconds: float,
    batch_seconds: float,
    virtual_time: bool,
    interrupted: bool,
    config: dict[str, Any],
) -> dict[str, Any]:
    """The summary of a batch over the selected tasks (`task_ids`)."""
    return {
        **batch_totals(batch.store.finished, task_ids, invalid_records, interrupted, wall_seconds),
        # loop time of this session's batch: wall-clock, or simulated seconds on virtual time
        "batch_seconds": round(batch_seconds, 3),
        "clock": "virtual" if virtual_time else "wall",
        **session_parts(batch, engine, why),
        "config": config,
        "host": {"python": platform.python_version(), "machine": platform.machine()},
    }


def session_parts(batch: Batch, engine: Engine, why: str) -> dict[str, Any]:
    """What one batch process reports of its session: its totals, engine, gate and sandbox
    (a worker of a batch over many nodes sends these to the driver)."""
    session = batch.totals
    bound = batch.workspace_bound()
    # the workspaces' filesystem kind in force: "watch" if any fell back to it
    fs = "watch" if bound["exact"] is False else batch.config.workspace_fs
    return {
        "this_session": {
            "agents_run": sum(session.by_status.values()),
            "agents_by_status": dict(session.by_status),
            "requests": session.requests,
            "prompt_tokens": session.prompt,
            "cached_tokens": session.cached,
            "generated_tokens": session.generated,
        },
        "engine": {
            "name": engine.name,
            "model": engine.model,
            "why": why,
            "context_limit": engine.context_limit,
            "cache": engine.cache_stats().extra,
            "stats": engine.stats() if isinstance(engine, EngineStats) else None,
        },
        "workspace_bound": bound,  # exact or watched (docs/sandbox.md)
        "gate": batch.controller.summary(),
        "sandbox": batch.sandbox.mode,
        # what really bounds the agents here (root/user/none, memory, processes, network)
        "limits": limits_in_force(batch.sandbox, batch.config.limits, fs),
    }
