"""Virtual time for asyncio: an event loop whose clock jumps to the next timer when nothing is
ready, so `asyncio.sleep(30)` costs no wall time and runs are deterministic.

The runner's asyncio code runs on it unchanged. Real I/O still works (it is polled without
blocking first; with no timer pending it is waited for, up to REAL_GRACE_S of wall time, so
worker threads can deliver results); only the waiting on timers is skipped. If nothing is
ready, no timer is scheduled and no I/O comes, every task waits on another: that deadlock is
raised, not hung.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(RuntimeError):
    pass


REAL_GRACE_S = 5.0  # with no timer, how long to wait for real I/O (a worker thread's result)


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            # Nothing scheduled: only real I/O can wake us, e.g. a thread finishing work for
            # asyncio.to_thread. Wait for it a bounded while; if it never comes, every task
            # waits on another.
            events = super().select(REAL_GRACE_S)
            if events:
                return events
            raise Deadlock("virtual time: no task is ready and no timer is scheduled")
        self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on virtual time."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
