"""The virtual-time loop: time jumps, its own view of the next timer, and the one asyncio
internal it reads (BaseEventLoop._ready), pinned to the Python versions it was checked on.

Runs without pytest too (`python tests/sim/test_vclock.py`), so it can be run on every
interpreter in TESTED_PYTHON without installing anything there."""

from __future__ import annotations

import asyncio
import math
import sys
from collections import deque

from runner.sim.vclock import TESTED_PYTHON, Deadlock, VirtualClock, VirtualTimeLoop, run_virtual


def test_python_is_in_the_tested_range():
    # has_ready_callbacks reads an asyncio internal: a new Python must be checked (run this
    # file on it) and added to TESTED_PYTHON.
    lo, hi = TESTED_PYTHON
    assert lo <= sys.version_info[:2] <= hi, (sys.version_info[:2], TESTED_PYTHON)


def test_sleep_jumps_and_costs_no_wall_time():
    import time

    async def main():
        loop = asyncio.get_running_loop()
        t0, w0 = loop.time(), time.perf_counter()
        await asyncio.sleep(3600)
        return loop.time() - t0, time.perf_counter() - w0

    virtual, wall = run_virtual(main())
    assert virtual == 3600 and wall < 1.0


def test_next_timer_sees_call_at_call_later_sleep_and_timeouts():
    async def main():
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualClock)
        seen = [loop.next_timer()]  # nothing pending
        h_far = loop.call_at(50.0, lambda: None)
        seen.append(loop.next_timer())
        h_mid = loop.call_later(20.0, lambda: None)
        seen.append(loop.next_timer())
        sleeper = asyncio.ensure_future(asyncio.sleep(5.0))
        await asyncio.sleep(0)  # let it schedule its timer
        seen.append(loop.next_timer())
        sleeper.cancel()  # cancels its timer
        await asyncio.sleep(0)
        seen.append(loop.next_timer())
        h_mid.cancel()
        seen.append(loop.next_timer())
        async with asyncio.timeout(30.0):  # asyncio.timeout schedules with call_at
            seen.append(loop.next_timer())
        seen.append(loop.next_timer())  # the timeout's timer is cancelled on exit
        fired = []
        loop.call_later(1.0, fired.append, "x")
        await asyncio.sleep(2.0)  # the 1 s timer runs first, then our 2 s sleep ends
        seen.append((fired, loop.time(), loop.next_timer()))
        h_far.cancel()
        seen.append(loop.next_timer())
        return seen

    seen = run_virtual(main())
    assert seen == [math.inf, 50.0, 20.0, 5.0, 20.0, 50.0, 30.0, 50.0, (["x"], 2.0, 50.0), math.inf]


def _ready_checks():
    """(before call_soon, after, after it ran, with a cancelled handle still queued)."""

    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)
        out = [loop.has_ready_callbacks()]
        loop.call_soon(lambda: None)
        out.append(loop.has_ready_callbacks())
        await asyncio.sleep(0)  # one loop iteration: the callback runs
        await asyncio.sleep(0)
        out.append(loop.has_ready_callbacks())
        loop.call_soon(lambda: None).cancel()  # asyncio drops it only when it reaches it
        out.append(loop.has_ready_callbacks())
        return out

    return run_virtual(main())


def test_has_ready_callbacks():
    assert _ready_checks() == [False, True, False, True]


def test_the_asyncio_internal_it_reads():
    # What has_ready_callbacks relies on: BaseEventLoop keeps the callbacks to run next in a
    # deque `_ready`, call_soon appends to it, and a timer that comes due is moved into it.
    loop = VirtualTimeLoop()
    try:
        assert isinstance(loop._ready, deque) and not loop._ready
        loop.call_soon(lambda: None)
        assert len(loop._ready) == 1
        loop.call_later(1.0, loop.stop)
        loop.run_forever()  # runs the callback, jumps 1 s, runs the timer (stop)
        assert not loop._ready and loop.time() == 1.0
    finally:
        loop.close()


def test_a_thread_job_takes_no_virtual_time():
    """While a thread works for the loop (to_thread: the run folder's writes), a pending timer
    does not make time jump: the job's result comes at the instant it was asked for, however
    long the thread takes, so a run's timings do not depend on the machine's speed."""
    import time

    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        loop.call_later(1.0, fired.append, "timer")
        await asyncio.to_thread(time.sleep, 0.2)
        at, seen = loop.time(), list(fired)
        await asyncio.sleep(2)
        return at, seen, fired

    at, seen, fired = run_virtual(main())
    assert at == 0.0 and seen == [] and fired == ["timer"]


def test_a_deadlock_is_raised_not_hung():
    import runner.sim.vclock as vclock

    async def main():
        await asyncio.get_running_loop().create_future()  # nobody will set it

    old, vclock.REAL_GRACE_S = vclock.REAL_GRACE_S, 0.05
    try:
        run_virtual(main())
    except Deadlock:
        pass
    else:
        raise AssertionError("no Deadlock")
    finally:
        vclock.REAL_GRACE_S = old


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print("ok", name)
