"""A worker of a batch over many nodes: one Ray actor that owns a whole runner (its engine, its
gate and controller, its sandbox) and runs one `Batch` fed from the driver.

The batch runs on its own thread with its own event loop (wall clock, or the simulator's
virtual time); the actor's methods run on Ray's threads. They meet in two places:
- the `Outbox`, where the batch's sink and source leave what the driver must hear (finished
  agents, errors, control lines, a request for tasks) and `exchange` collects it;
- the task source, to which `exchange` delivers the driver's answer.

This module does not import Ray: the driver makes the class an actor (`ray.remote`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

from ..batch.batch import Batch, EngineDead
from ..batch.session import session_parts
from ..engines.protocol import Engine, TaskScripted
from ..tasks.tasks import Task
from .protocol import (
    GATHER_S,
    POLL_S,
    TRAJECTORIES,
    Feed,
    Finished,
    Report,
    Want,
    WorkerDone,
    WorkerInfo,
    WorkerSpec,
)

log = logging.getLogger("concur")


class Outbox:
    """What the worker has to tell the driver, collected by the next `exchange`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._report = Report()

    def finished(self, item: Finished) -> None:
        with self._cond:
            self._report.finished.append(item)
            self._cond.notify_all()

    def error(self, record: dict[str, Any]) -> None:
        with self._cond:
            self._report.errors.append(record)
            self._cond.notify_all()

    def control(self, line: dict[str, Any]) -> None:
        with self._cond:
            self._report.control.append(line)
            self._cond.notify_all()

    def want(self, want: Want) -> None:
        with self._cond:
            self._report.want = want
            self._cond.notify_all()

    def done(self, done: WorkerDone) -> None:
        with self._cond:
            self._report.done = done
            self._cond.notify_all()

    def collect(self, timeout: float = POLL_S, gather: float = GATHER_S) -> Report:
        """Wait up to `timeout` for something to report, then a moment more for what comes
        with it; hand it all over."""
        with self._cond:
            if self._report.empty():
                self._cond.wait(timeout)
            if not self._report.empty() and gather > 0:
                self._cond.wait(gather)
            report, self._report = self._report, Report()
            return report


class RelaySink:
    """The batch's RecordSink in a worker: every record goes to the driver, which alone writes
    the run folder. A record file other than trajectories.jsonl (e.g. the outputs issue's
    rollouts) goes with its agent's trajectory. Nothing here blocks (the outbox is memory)."""

    def __init__(self, outbox: Outbox, attempts: Mapping[str, str]) -> None:
        self._outbox = outbox
        self._attempts = attempts  # task id -> the attempt this worker runs
        self.finished: dict[str, dict[str, Any]] = {}  # resume is the driver's: none here

    async def finish(self, record: dict[str, Any], extra: Mapping[str, dict[str, Any]]) -> None:
        tid = record["task_id"]
        records = {**extra, TRAJECTORIES: record}
        self._outbox.finished(Finished(tid, self._attempts.get(tid, "?"), records))

    async def log_error(self, record: dict[str, Any]) -> None:
        tid = record.get("task_id")
        attempt = (
            {"attempt": self._attempts[tid]} if tid is not None and tid in self._attempts else {}
        )
        self._outbox.error({"time": time.time(), **record, **attempt})

    async def log_control(self, line: dict[str, Any]) -> None:
        self._outbox.control(line)


class _Source:
    """The batch's TaskSource: asks the driver (through the outbox) and waits for `deliver`."""

    def __init__(self, outbox: Outbox, engine: Engine, attempts: dict[str, str]) -> None:
        self._outbox = outbox
        self._engine = engine
        self._attempts = attempts
        self._coming = 0

    def coming(self) -> int:
        return self._coming

    def deliver(self, feed: Feed) -> None:
        """Called on an actor thread with the driver's feed."""
        self._coming = feed.coming
        if feed.tasks is None and not feed.final:
            return
        tasks: list[Task] | None = None
        if feed.tasks:
            for a in feed.tasks:
                self._attempts[a.task.id] = a.attempt
            tasks = [a.task for a in feed.tasks]
            if isinstance(self._engine, TaskScripted):
                self._engine.add_tasks(tasks)
        elif not feed.final:
            tasks = []
        self._answer(tasks)

    def _answer(self, tasks: list[Task] | None) -> None:
        raise NotImplementedError


class AsyncSource(_Source):
    """Wall clock: the batch's loop awaits the answer; its agents run meanwhile."""

    def __init__(self, outbox: Outbox, engine: Engine, attempts: dict[str, str]) -> None:
        super().__init__(outbox, engine, attempts)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: asyncio.Future[list[Task] | None] | None = None

    async def take(self, n: int, idle: bool) -> list[Task] | None:
        self._loop = asyncio.get_running_loop()
        self._waiting = self._loop.create_future()
        self._outbox.want(Want(n, idle))
        try:
            return await self._waiting
        finally:
            self._waiting = None

    def _answer(self, tasks: list[Task] | None) -> None:
        fut, loop = self._waiting, self._loop
        if fut is None or loop is None:
            return

        def settle() -> None:
            if not fut.done():
                fut.set_result(tasks)

        loop.call_soon_threadsafe(settle)


class BlockingSource(_Source):
    """Virtual time (--engine sim): the batch's loop blocks until the answer comes, so no
    simulated time passes while the driver answers (a real wait would let the virtual clock
    jump through control periods with nothing happening)."""

    def __init__(self, outbox: Outbox, engine: Engine, attempts: dict[str, str]) -> None:
        super().__init__(outbox, engine, attempts)
        self._answers: queue.Queue[list[Task] | None] = queue.Queue()

    async def take(self, n: int, idle: bool) -> list[Task] | None:
        self._outbox.want(Want(n, idle))
        return self._answers.get()  # blocks the loop on purpose (see the class docstring)

    def _answer(self, tasks: list[Task] | None) -> None:
        self._answers.put(tasks)


class Worker:
    """The actor (the driver wraps it with `ray.remote`). Methods run on Ray's threads."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.outbox = Outbox()
        self._source: _Source | None = None
        self._batch: Batch | None = None
        self._thread: threading.Thread | None = None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray  # only ever called inside a Ray actor

        return str(ray.get_runtime_context().get_node_id())

    def start(self, node_id: str, coming: int) -> WorkerInfo:
        """Build the engine, sandbox and batch on this node and start the batch's thread.
        `coming`: the tasks this worker may get (its gate's first window is sized on them,
        as a single-process gate is on the whole batch)."""
        logging.getLogger("concur").setLevel(self.spec.log_level)
        built = self.spec.make_engine()
        config = dataclasses.replace(
            self.spec.config, constrain_tool_calls=built.constrain_tool_calls
        )
        sandbox = self.spec.make_sandbox()
        attempts: dict[str, str] = {}
        kind = BlockingSource if self.spec.virtual_time else AsyncSource
        source = kind(self.outbox, built.engine, attempts)
        source.deliver(Feed(coming=coming))
        self._source = source
        sink = RelaySink(self.outbox, attempts)
        batch = Batch([], built.engine, sandbox, self.spec.policy, sink, config,
                      source=source)  # fmt: skip
        self._batch = batch
        self._thread = threading.Thread(
            target=self._main, args=(batch, built.engine, built.why), daemon=True
        )
        self._thread.start()
        return WorkerInfo(
            index=self.spec.index,
            node_id=node_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            engine=built.engine.name,
            model=built.engine.model,
            why=built.why,
        )

    def exchange(self, feed: Feed) -> Report:
        if self._source is None or self._batch is None:
            raise RuntimeError("exchange before start")
        self._source.deliver(feed)
        report = self.outbox.collect()
        report.status = self._batch.status()  # counters only: safe to read from this thread
        return report

    def _main(self, batch: Batch, engine: Engine, why: str) -> None:
        error: str | None = None
        run = self.spec.run_loop or asyncio.run
        seconds: list[float] = []
        try:
            run(_session(batch, engine, seconds))
        except EngineDead as e:
            error = f"the engine died: {e}"
        except BaseException as e:  # reported to the driver, which puts the tasks back
            error = f"the worker's batch crashed: {type(e).__name__}: {e}"
            log.error("%s\n%s", error, traceback.format_exc())
        try:
            parts = session_parts(batch, engine, why)
            parts["batch_seconds"] = round(seconds[0], 3) if seconds else None
            parts["clock"] = "virtual" if self.spec.virtual_time else "wall"
        except Exception as e:  # the figures must not hide the end itself
            parts = {"error": f"no session figures: {type(e).__name__}: {e}"}
        self.outbox.done(WorkerDone(parts, error))


async def _session(batch: Batch, engine: Engine, seconds: list[float]) -> None:
    """Run the batch, close the engine; the loop time it took goes into `seconds`."""
    t0 = asyncio.get_running_loop().time()
    try:
        await batch.run()
    finally:
        await engine.aclose()
        seconds.append(asyncio.get_running_loop().time() - t0)
