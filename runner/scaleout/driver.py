"""The driver of a batch over many nodes: it owns the dataset, the resume index and the one run
folder (with its lock); Ray actors (worker.py) each run a whole runner and pull tasks.

One coroutine per worker calls its `exchange` in a loop (protocol.py). Each report's records
are written (errors, other record files, then trajectories; each file synced once per report)
before their tasks count as done; then the worker's request for tasks is answered from the
ledger (ledger.py). A worker whose call fails is lost: its unfinished tasks go back to the
queue and run on the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..batch.progress import BatchStatus, Progress
from ..runfolder.store import RunStore
from ..tasks.tasks import Task
from .handle import Handle
from .ledger import Ledger
from .protocol import TRAJECTORIES, Feed, Report, WorkerSpec
from .summary import distributed_summary
from .worker import Worker

log = logging.getLogger("concur")
NAMESPACE = "concur-runner"
PLACE_TIMEOUT_S = 120.0  # a worker the cluster cannot place by then is given up
INSTALL = "pip install 'concur-runner[ray]' (or: pip install 'ray>=2.40')"


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached: the message says how to fix it."""


# Ray rewrites 127.0.0.1 to this machine's outward address unless this is "0" when it is
# first imported (docs/scale-out.md): set for a local cluster, so it binds to loopback only.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@dataclass(frozen=True)
class Target:
    """The cluster to join (address None: start a local one) and how it was chosen."""

    address: str | None
    how: str
    probed: bool = False  # resolve already found something listening at the address


def recorded_address_file() -> Path:
    """Where `ray start` records the address of the cluster it started on this machine
    (Ray's own rule: ray._common.utils.get_ray_address_file, read without importing ray, so
    that a local cluster can still be put on loopback)."""
    tmp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(tmp) / "ray" / "ray_current_cluster"


def resolve(address: str | None) -> Target:
    """`--ray ADDRESS` as given (`local`: a new local cluster); `--ray` alone: $RAY_ADDRESS,
    else the cluster last started on this machine with `ray start` if it answers, else a new
    local cluster on 127.0.0.1 (Ray's own ray.init() would bind it to the outward address)."""
    if address == "local":
        return Target(None, "a local Ray cluster on 127.0.0.1 (this machine only)")
    if address:
        return Target(address, f"--ray {address}")
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return Target(env, f"$RAY_ADDRESS={env}")
    path = recorded_address_file()
    try:
        recorded = path.read_text(encoding="utf-8").strip()
    except OSError:
        recorded = ""
    if recorded:
        try:
            check_reachable(recorded, timeout=2.0)
            how = f"the cluster started on this machine ({path}: {recorded})"
            return Target(recorded, how, probed=True)
        except RayUnavailable:
            log.warning(
                "%s names the Ray cluster %s, which does not answer (stopped?): starting a "
                "local one instead",
                path,
                recorded,
            )
    return Target(None, "a local Ray cluster on 127.0.0.1 (this machine only)")


def reach(address: str | None) -> Target:
    """The cluster `resolve(address)` picks, found listening (fail fast, instead of Ray's long
    retries): each address probed once."""
    target = resolve(address)
    where = target.address
    if where and "://" not in where and where not in ("auto", "local") and not target.probed:
        check_reachable(where)
    return target


def connect(address: str | None) -> tuple[Any, Target]:
    """ray.init on the cluster `reach(address)` finds. Returns the ray module and it."""
    target = reach(address)
    if target.address is None:
        os.environ.setdefault(LOOPBACK_ENV, "0")  # before Ray is imported
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(f"--ray needs the ray package ({e}): {INSTALL}") from None
    where = target.address
    options: dict[str, Any] = {}
    host = (where or "").rsplit(":", 1)[0]
    if where is None or host in ("127.0.0.1", "localhost"):  # this driver joins on loopback
        options["_node_ip_address"] = "127.0.0.1"
    import runner
    import tools

    log.info("Ray: %s", target.how)
    try:
        ray.init(
            address=where or "local",
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            # every worker runs this driver's code (its runner and tools packages)
            runtime_env={"py_modules": [runner, tools]},
            **options,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayUnavailable(
            f"cannot join the Ray cluster at {where or '(local)'}: {e}. Start one with "
            "`ray start --head` (and `ray start --address=HEAD:6379` on the other nodes), or "
            "pass the address `ray status` shows"
        ) from None
    return ray, target


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast (instead of Ray's long retries) when nothing listens at host:port."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(f"--ray {address}: expected HOST:PORT (e.g. 10.0.0.1:6379)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise RayUnavailable(
            f"cannot reach a Ray cluster at {address}: {e}. Start its head there with "
            f"`ray start --head --port={port}`, or pass the address `ray status` shows on it"
        ) from None


@dataclass
class DriverOutcome:
    summary: dict[str, Any]
    exit_code: int  # 0 all done, 1 tasks left unfinished (workers lost), 130 interrupted


class Driver:
    def __init__(
        self,
        ray: Any,
        store: RunStore,
        tasks: list[Task],
        make_spec: Callable[[int], WorkerSpec],
        workers: int | None = None,
        gpus_per_worker: int = 0,
        progress: Progress | None = None,
    ) -> None:
        self.ray = ray
        self.store = store
        self.ledger = Ledger(tasks)
        self.make_spec = make_spec
        self.n_workers = workers
        self.gpus = gpus_per_worker
        self.progress = progress
        self.handles: list[Handle] = []
        self.handling_seconds = 0.0  # the driver's work on records: checks, writes, syncs
        self.handling_cpu_seconds = 0.0  # ... its CPU part (without waiting on the disk)
        self.records = 0
        self.t_first_task: float | None = None
        self._started = 0
        self._all_started = asyncio.Event()  # no task is handed out before every worker is up
        self.t_last_record: float | None = None
        self._taking_in = asyncio.Lock()

    # ---- the run ----------------------------------------------------------------------

    async def run(self) -> None:
        self.handles = self._launch()
        async with asyncio.TaskGroup() as tg:
            ui = tg.create_task(self.progress.run(self.status)) if self.progress else None
            async with asyncio.TaskGroup() as lives:
                for h in self.handles:
                    lives.create_task(self._life(h))
            if ui:
                ui.cancel()

    def _launch(self) -> list[Handle]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        per_node = self.n_workers is None
        n = self.n_workers or default_workers(nodes, self.gpus)
        if n < 1:
            raise RayUnavailable(
                f"the cluster has no node with {self.gpus} GPUs free for one worker "
                "(`ray status` shows its resources); pass --workers N or smaller --tp/--dp"
            )
        cls = self.ray.remote(Worker)
        handles = []
        for k in range(n):
            opts: dict[str, Any] = {
                "num_cpus": 1,
                "num_gpus": self.gpus,
                "name": f"concur-{self.ledger.session}-w{k}",
                "max_restarts": 0,
                "max_concurrency": 4,  # exchange, pid, start: never queued behind each other
                "scheduling_strategy": "SPREAD",
            }
            if per_node and self.gpus == 0:  # one worker on each node
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    nodes[k]["NodeID"], soft=False
                )
            handles.append(Handle(k, cls.options(**opts).remote(self.make_spec(k))))
        log.info(
            "%d workers over %d nodes at %s (Ray session %s)",
            n,
            len(nodes),
            ", ".join(sorted({str(x.get("NodeManagerAddress")) for x in nodes})),
            self.ledger.session,
        )
        return handles

    async def _life(self, h: Handle) -> None:
        try:
            started = await self._start(h)
        finally:
            self._started += 1
            if self._started == len(self.handles):
                self._all_started.set()
        if started:
            # Every worker starts with its share: the first one up (or, on virtual time, the
            # first to finish) must not take what the others are there for.
            await self._all_started.wait()
            await self._serve(h)

    async def _start(self, h: Handle) -> bool:
        try:
            await asyncio.wait_for(h.actor.pid.remote(), PLACE_TIMEOUT_S)
            node = await h.actor.node_id.remote()
            h.info = await h.actor.start.remote(node, self._share())
        except TimeoutError:
            await self._lose(
                h, f"not placed within {PLACE_TIMEOUT_S:.0f}s (`ray status`: resources)"
            )
            self.ray.kill(h.actor)
            return False
        except self.ray.exceptions.RayError as e:
            await self._lose(h, f"could not start: {_brief(e)}")
            return False
        log.info(
            "worker %d: pid %d on %s (node %s), engine %s",
            h.index,
            h.info.pid,
            h.info.host,
            h.info.node_id[:12],
            h.info.engine,
        )
        return True

    async def _serve(self, h: Handle) -> None:
        feed = Feed(coming=self._share())
        while True:
            try:
                report: Report = await h.actor.exchange.remote(feed)
            except self.ray.exceptions.RayError as e:
                await self._lose(h, _brief(e))
                return
            await self._take_in(h, report)
            if report.done is not None:
                h.done = report.done
                if report.done.error:
                    h.done = None
                    await self._lose(h, report.done.error)
                return
            feed = self._answer(h)

    # ---- records ------------------------------------------------------------------------

    async def _take_in(self, h: Handle, report: Report) -> None:
        """Write what the report carries (on the run folder's writer thread); only then do
        its tasks count as done. One report at a time: whether an attempt is its task's
        first is checked before the writes and committed after them."""
        async with self._taking_in:
            t0 = time.perf_counter()
            if report.status is not None:
                h.status = report.status
            if report.want is not None:
                h.want = report.want
            keep, seen, discarded = [], set(), []
            for f in report.finished:
                if f.task_id in seen or not self.ledger.is_first(f.task_id):
                    discarded.append(self._discard(h, f.task_id, f.attempt))
                    continue
                seen.add(f.task_id)
                keep.append(f)
            errors = [{**e, "worker": h.index} for e in report.errors] + discarded
            cpu, trajectories = await self.store.off_loop(self._write, h, report, keep, errors)
            for rec in trajectories:
                self.ledger.commit(rec["task_id"])
                h.kept += 1
                h.by_status[rec["status"]] = h.by_status.get(rec["status"], 0) + 1
            if report.finished:
                self.records += len(report.finished)
                self.handling_seconds += time.perf_counter() - t0
                self.handling_cpu_seconds += cpu
                self.t_last_record = time.monotonic()

    def _write(
        self, h: Handle, report: Report, keep: list[Any], errors: list[dict[str, Any]]
    ) -> tuple[float, list[dict[str, Any]]]:
        """(On the writer thread.) -> the CPU seconds it took, the trajectories written."""
        c0 = time.thread_time()
        s = self.store
        if errors:
            s.append_records("errors.jsonl", errors)
        tag = {"worker": h.index}
        extra: dict[str, list[dict[str, Any]]] = {}
        for f in keep:  # other record files first: the trajectory marks the task done
            for name, rec in f.records.items():
                if name != TRAJECTORIES:
                    extra.setdefault(name, []).append({**rec, **tag, "attempt": f.attempt})
        for name, recs in extra.items():
            s.append_records(name, recs)
        trajectories = [
            {**f.records[TRAJECTORIES], **tag, "attempt": f.attempt}
            for f in keep
            if TRAJECTORIES in f.records
        ]
        s.add_trajectories(trajectories)
        if report.control:
            s.append_records("control.jsonl", [{**tag, **line} for line in report.control])
        return time.thread_time() - c0, trajectories

    def _discard(self, h: Handle, task_id: str, attempt: str) -> dict[str, Any]:
        """-> the error record of a discarded attempt."""
        kept = self.store.finished.get(task_id, {}).get("attempt")
        h.discarded += 1
        log.warning(
            "task %s: attempt %s from worker %d finished after attempt %s was kept: discarded",
            task_id,
            attempt,
            h.index,
            kept,
        )
        return {
            "time": time.time(),
            "kind": "discarded_attempt",
            "task_id": task_id,
            "attempt": attempt,
            "worker": h.index,
            "kept_attempt": kept,
        }

    # ---- assignment ---------------------------------------------------------------------

    def _share(self) -> int:
        return self.ledger.share(sum(1 for h in self.handles if h.alive))

    def _answer(self, h: Handle) -> Feed:
        """The next feed: tasks for an open request, [] (none now), the end, or no answer yet
        (an idle worker waits for tasks put back by a lost worker, or for the end)."""
        want = h.want
        if want is None:
            return Feed(coming=self._share())
        tasks = self.ledger.take(h.index, min(want.n, self._share()))
        if tasks:
            h.want = None
            if self.t_first_task is None:
                self.t_first_task = time.monotonic()
            return Feed(tasks=tasks, coming=self._share())
        if self.ledger.all_done:
            h.want = None
            return Feed(final=True)
        if not want.idle:
            h.want = None
            return Feed(tasks=[], coming=self._share())
        return Feed(coming=self._share())

    async def _lose(self, h: Handle, why: str) -> None:
        h.lost = why
        back = self.ledger.lost(h.index)
        h.put_back = back
        log.error(
            "worker %d lost: %s; %d unfinished tasks go back to the queue%s",
            h.index,
            why,
            len(back),
            f": {', '.join(back[:10])}{' ...' if len(back) > 10 else ''}" if back else "",
        )
        await self.store.log_error({"kind": "worker_lost", "worker": h.index, "reason": why,
                                    "put_back": back})  # fmt: skip

    # ---- reporting ----------------------------------------------------------------------

    def status(self) -> BatchStatus:
        live = [h.status for h in self.handles if h.status is not None and h.alive]
        return BatchStatus(
            done=sum(h.kept for h in self.handles),
            total=len(self.ledger.tasks),
            active=sum(s.active for s in live),
            paused=sum(s.paused for s in live),
            pending=sum(s.pending for s in live),
            window=sum(s.window for s in live),
            steps=sum(s.steps for s in live),
            generated_tokens=sum(s.generated_tokens for s in live),
            hit=None,
            u=None,
            h=None,
        )

    def figures(self) -> dict[str, Any]:
        """The driver's own figures (summary.json `scaleout`)."""
        span = (
            self.t_last_record - self.t_first_task
            if self.t_first_task is not None and self.t_last_record is not None
            else None
        )
        return {
            "session": self.ledger.session,
            "workers": len(self.handles),
            "workers_lost": sum(1 for h in self.handles if h.lost),
            "tasks_put_back": self.ledger.put_back,
            "attempts_discarded": sum(h.discarded for h in self.handles),
            "records_received": self.records,
            "driver_seconds_per_record": (
                round(self.handling_seconds / self.records, 6) if self.records else None
            ),
            "driver_cpu_seconds_per_record_handled": (
                round(self.handling_cpu_seconds / self.records, 6) if self.records else None
            ),
            "seconds_first_task_to_last_record": None if span is None else round(span, 3),
        }


def default_workers(nodes: list[dict[str, Any]], gpus_per_worker: int) -> int:
    """One worker per node; with GPU engines, one per group of gpus_per_worker GPUs."""
    if gpus_per_worker <= 0:
        return len(nodes)
    return sum(int(n.get("Resources", {}).get("GPU", 0)) // gpus_per_worker for n in nodes)


def _brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def run(
    *,
    address: str | None,
    store: RunStore,
    tasks: list[Task],
    make_spec: Callable[[int], WorkerSpec],
    workers: int | None,
    gpus_per_worker: int,
    progress: Progress | None,
    task_ids: list[str],
    invalid_records: int,
    config: dict[str, Any],
) -> DriverOutcome:
    """Join the cluster, run `tasks` on its workers, write summary.json whatever happened.
    Raises RayUnavailable (nothing run) when Ray is missing or the cluster cannot be joined."""
    ray, target = connect(address)
    driver = Driver(ray, store, tasks, make_spec, workers, gpus_per_worker, progress)
    wall0, cpu0 = time.monotonic(), time.process_time()
    interrupted, code = False, 0
    try:
        asyncio.run(driver.run())
        if not driver.ledger.all_done:
            interrupted, code = True, 1
            left = driver.ledger.unfinished
            log.error(
                "every worker was lost with %d tasks unfinished; finished agents are saved; "
                "run the same command to resume",
                len(left),
            )
    except KeyboardInterrupt:
        interrupted, code = True, 130
        log.warning("interrupted: finished agents are saved; run the same command to resume")
    finally:
        figures = driver.figures()
        records = figures["records_received"]
        cpu = time.process_time() - cpu0
        figures["driver_cpu_seconds_per_record"] = round(cpu / records, 6) if records else None
        summary = distributed_summary(
            store,
            driver.handles,
            task_ids=task_ids,
            invalid_records=invalid_records,
            wall_seconds=time.monotonic() - wall0,
            interrupted=interrupted,
            config=config,
            figures={
                **figures,
                "ray_address": target.address or "local",
                "ray_cluster": target.how,
            },
        )
        store.write_summary(summary)
        ray.shutdown()
    return DriverOutcome(summary, code)
