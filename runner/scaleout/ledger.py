"""The driver's book of tasks: which are queued, which attempt of which runs where, which are
done. Pure bookkeeping (no Ray, no I/O): every rule about losing or duplicating work is here.

- A task is handed out as an attempt (`<session>.<n>`); it is done when the first record of
  any of its attempts is written. A later record of the same task is discarded (said so).
- A worker that is lost gives back its live attempts: each task without another live attempt
  goes back to the front of the queue, to run on whichever worker asks next.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field

from ..tasks.tasks import Task
from .protocol import Assignment


@dataclass
class Ledger:
    tasks: list[Task]
    session: str = field(default_factory=lambda: secrets.token_hex(4))

    def __post_init__(self) -> None:
        self.queue: deque[Task] = deque(self.tasks)
        self.live: dict[str, dict[str, int]] = {}  # task id -> attempt -> worker
        self.done: set[str] = set()
        self.put_back = 0
        self._task: dict[str, Task] = {t.id: t for t in self.tasks}
        self._n = itertools.count(1)

    def take(self, worker: int, n: int) -> list[Assignment]:
        out: list[Assignment] = []
        while self.queue and len(out) < n:
            task = self.queue.popleft()
            attempt = f"{self.session}.{next(self._n)}"
            self.live.setdefault(task.id, {})[attempt] = worker
            out.append(Assignment(task, attempt))
        return out

    def is_first(self, task_id: str) -> bool:
        """Whether a record of this task is the one to keep (no record of it written yet)."""
        return task_id not in self.done and task_id in self._task

    def commit(self, task_id: str) -> None:
        """The task's record is written: the task is done; its other attempts are stale."""
        self.done.add(task_id)
        self.live.pop(task_id, None)

    def lost(self, worker: int) -> list[str]:
        """`worker` is gone: its unfinished tasks go back to the front of the queue (in task
        order). Returns their ids."""
        back = []
        for tid, attempts in list(self.live.items()):
            for attempt in [a for a, w in attempts.items() if w == worker]:
                del attempts[attempt]
            if not attempts:
                del self.live[tid]
                if tid not in self.done:
                    back.append(tid)
        self.queue.extendleft(self._task[t] for t in reversed(back))
        self.put_back += len(back)
        return back

    def running_on(self, worker: int) -> int:
        return sum(1 for a in self.live.values() if worker in a.values())

    def share(self, workers: int) -> int:
        """What one of `workers` workers may still be handed: a fair part of the queue."""
        return -(-len(self.queue) // max(1, workers))

    @property
    def all_done(self) -> bool:
        return not self.queue and not self.live

    @property
    def unfinished(self) -> list[str]:
        return [t.id for t in self.tasks if t.id not in self.done]
