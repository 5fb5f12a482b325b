"""The messages between the driver and its workers (plain dataclasses; Ray pickles them).

The driver calls each worker's `exchange(Feed) -> Report` in a loop, one call at a time:
the feed carries the answer to the worker's last request for tasks (if any), the report
carries everything the worker has to say since the last call (finished agents, errors,
control lines, a request for tasks, its status, its end). A worker answers at once when it
has something to say, else after POLL_S.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from tools.sandbox import CommandSandbox

from ..batch.batch import BatchConfig
from ..batch.progress import BatchStatus
from ..engines.protocol import Engine
from ..policies.protocol import Policy
from ..tasks.tasks import Task

POLL_S = 0.25  # longest a worker holds an exchange with nothing to report
GATHER_S = 0.005  # once it has something, how long it waits for more to send together
TRAJECTORIES = "trajectories.jsonl"
# Each worker's agents run as uids of a range of its own: two workers on one host (or a
# worker and its node's other runs) never share a uid. Also the most agents one worker
# runs at once: its agents reuse the uids of ended ones.
UIDS_PER_WORKER = 10_000


def worker_uid_base(run_uid_base: int, index: int) -> int:
    """The first uid of worker `index` of a run whose agents start at `run_uid_base`."""
    return run_uid_base + index * UIDS_PER_WORKER


@dataclass(frozen=True)
class Assignment:
    """One task handed to one worker. The attempt id tells two runs of a task apart."""

    task: Task
    attempt: str


@dataclass
class Feed:
    """Driver -> worker."""

    tasks: list[Assignment] | None = None  # the answer to the open Want; None: no answer yet
    final: bool = False  # no task will ever come again: the worker's batch may end
    coming: int = 0  # tasks the driver may still hand this worker (its gate's bound)


@dataclass(frozen=True)
class Want:
    """Worker -> driver: its gate has room for `n` more agents. `idle`: it has none left, so
    the driver may hold the answer until there is work (or the end)."""

    n: int
    idle: bool


@dataclass
class Finished:
    """One finished agent: its records, by the run-folder file each belongs to. The
    trajectory (TRAJECTORIES) is written last: it is what marks the task done."""

    task_id: str
    attempt: str
    records: dict[str, dict[str, Any]]


@dataclass
class Report:
    """Worker -> driver."""

    finished: list[Finished] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    control: list[dict[str, Any]] = field(default_factory=list)
    want: Want | None = None
    status: BatchStatus | None = None
    done: WorkerDone | None = None

    def empty(self) -> bool:
        return not (self.finished or self.errors or self.control or self.want or self.done)


@dataclass
class WorkerDone:
    """The worker's batch ended: its session's figures (summary.session_parts), or why it
    failed (the engine died, the worker crashed)."""

    parts: dict[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class EngineBuild:
    """What a worker's engine factory returns."""

    engine: Engine
    why: str
    constrain_tool_calls: bool = False  # --constrain-tool-calls, decided for this engine


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its own runner. The factories are module-level
    callables (pickled by reference): the worker calls them on its own node."""

    index: int
    config: BatchConfig  # uid_base and workspace_root are this worker's own
    policy: Policy
    make_engine: Callable[[], EngineBuild]
    make_sandbox: Callable[[], CommandSandbox]
    # asyncio.run, or the simulator's virtual time (runner/sim/vclock.py)
    run_loop: Callable[[Coroutine[Any, Any, None]], None] | None = None
    virtual_time: bool = False
    log_level: int = 30  # logging.WARNING: the driver's console gets the worker's warnings


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker runs and what it runs."""

    index: int
    node_id: str
    host: str
    pid: int
    engine: str
    model: str
    why: str
