"""Virtual time for asyncio: an event loop whose clock jumps to the next timer when nothing is
ready, so `asyncio.sleep(30)` costs no wall time and runs are deterministic.

The runner's asyncio code runs on it unchanged. Real I/O still works (it is polled without
blocking first; with no timer pending it is waited for, up to REAL_GRACE_S of wall time, so
worker threads can deliver results); only the waiting on timers is skipped. A job on an
executor (`run_in_executor`, `asyncio.to_thread`: the run folder's writes) takes no virtual
time: the clock does not move until it is done, as if the loop had run it itself. If nothing is
ready, no timer is scheduled and no I/O comes, every task waits on another: that deadlock is
raised, not hung.

The loop also answers two questions the simulated engine asks before it plans work
(`VirtualClock`): when the next timer is due (`next_timer`, kept by the loop itself from the
public `call_at` / `call_later`) and whether callbacks are queued to run at this instant
(`has_ready_callbacks`, the one place that reads an asyncio internal; see there).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import selectors
import sys
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from contextvars import Context
from typing import Any, Generic, Protocol, TypeVar, TypeVarTuple, runtime_checkable

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# CPython versions whose asyncio `BaseEventLoop._ready` was checked to behave as
# has_ready_callbacks assumes (run: tests/sim/test_vclock.py on 3.11, 3.12 and 3.13).
TESTED_PYTHON = ((3, 11), (3, 13))


class Deadlock(RuntimeError):
    pass


# with no timer and no executor job, how long to wait for real I/O (a thread other than the
# loop's executor waking it: call_soon_threadsafe)
REAL_GRACE_S = 5.0


@runtime_checkable
class VirtualClock(Protocol):
    """What the simulated engine needs from its event loop to plan exactly (VirtualTimeLoop
    has it; on any other loop the engine plans without it)."""

    def next_timer(self) -> float:
        """When the earliest pending timer is due (loop time); +inf when none is."""
        ...

    def has_ready_callbacks(self) -> bool:
        """Whether callbacks are queued to run before the loop next waits or moves time."""
        ...


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.in_threads = 0  # executor jobs of the loop not yet done (asyncio.to_thread, ...)

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if self.in_threads:
            # Time stands still while a thread works for the loop, as it does while the loop
            # itself computes: the job's end (its wake-up of the loop) comes first, at this
            # instant, however long it takes in wall time. Otherwise when its result lands
            # in virtual time would depend on the machine's speed.
            return super().select(None)
        if timeout is None:
            # Nothing scheduled: only real I/O can wake us, e.g. a thread other than the
            # loop's executor (call_soon_threadsafe). Wait for it a bounded while; if it
            # never comes, every task waits on another.
            events = super().select(REAL_GRACE_S)
            if events:
                return events
            raise Deadlock("virtual time: no task is ready and no timer is scheduled")
        self.now += timeout
        return []


class _Timer(Generic[*Ts]):
    """A timer's callback, wrapped so the loop knows when it has run."""

    __slots__ = ("callback", "fired")

    def __init__(self, callback: Callable[[*Ts], object]) -> None:
        self.callback = callback
        self.fired = False

    def __call__(self, *args: *Ts) -> object:
        self.fired = True
        return self.callback(*args)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)
        # Every timer handed out by call_at / call_later, earliest first; entries whose timer
        # ran or was cancelled are dropped lazily by next_timer.
        self._vt_timers: list[tuple[float, int, _Timer[Any], asyncio.TimerHandle]] = []
        self._vt_seq = itertools.count()

    def time(self) -> float:
        return self._jumping.now

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts
    ) -> asyncio.Future[T]:
        job = super().run_in_executor(executor, func, *args)
        self._jumping.in_threads += 1
        job.add_done_callback(self._thread_done)
        return job

    def _thread_done(self, _job: asyncio.Future[Any]) -> None:
        self._jumping.in_threads -= 1

    def call_at(
        self,
        when: float,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        timer: _Timer[*Ts] = _Timer(callback)
        handle = super().call_at(when, timer, *args, context=context)
        heapq.heappush(self._vt_timers, (handle.when(), next(self._vt_seq), timer, handle))
        return handle

    def call_later(
        self,
        delay: float,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        # BaseEventLoop.call_later's own arithmetic, through our call_at in every case
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self.time() + delay, callback, *args, context=context)

    def next_timer(self) -> float:
        timers = self._vt_timers
        while timers and (timers[0][2].fired or timers[0][3].cancelled()):
            heapq.heappop(timers)
        return timers[0][0] if timers else math.inf

    def has_ready_callbacks(self) -> bool:
        """asyncio has no public way to ask this. The engine must know, when it plans an
        iteration, whether callbacks already queued (an agent woken by the last iteration's
        result) will still run at this instant and may submit a request. Shadowing the queue
        through public methods would mean re-implementing asyncio's own bookkeeping (call_soon,
        due timers, I/O callbacks, cancelled handles), which is more fragile than reading the
        one deque `BaseEventLoop._ready` (its callbacks to run next). Checked on TESTED_PYTHON
        by tests/sim/test_vclock.py."""
        return bool(_ready_queue(self))


def _ready_queue(loop: asyncio.AbstractEventLoop) -> Any:
    ready = getattr(loop, "_ready", None)
    if ready is None:
        raise RuntimeError(
            f"asyncio on Python {sys.version_info[:2]} has no BaseEventLoop._ready; "
            f"virtual time was checked on {TESTED_PYTHON[0]} to {TESTED_PYTHON[1]}"
        )
    return ready


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on virtual time."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
