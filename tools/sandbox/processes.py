"""The process plumbing of one command: spawn it, collect its output (capped, drained), watch
its wall clock and its workspace's size, kill it (for bwrap: the pid namespace's pid 1) and
make sure nothing of it is left (reaped, namespace gone, pipes closed).

Not via asyncio's subprocess transports: their wait() can hang while an escaped grandchild
holds a pipe. Exit is seen through a pidfd, one shared future per process (two add_reader
calls on one fd would silently replace each other).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from .bwrap import INNER_PATH
from .filesystem import disk_usage
from .limits import Limits

log = logging.getLogger("concur.sandbox")

_KILL_GRACE_S = 2.0  # after SIGKILL to the namespace, how long bwrap gets to reap it and exit
_DRAIN_GRACE_S = 2.0  # after the process is gone, how long to wait for the output pipe's EOF
# While a command runs, the workspace's size is checked every _WATCH_MIN_S seconds (or 10x the
# time one check took, whichever is longer): past Limits.workspace_bytes the command is killed.
_WATCH_MIN_S = 0.5

# Commands in flight per uid, across all Sandbox instances of this process: the "none" mode
# sweep (kill every process of the uid) must not hit a sibling command of the same agent.
_INFLIGHT: Counter[int] = Counter()


@contextlib.contextmanager
def inflight(uid: int) -> Iterator[None]:
    """Count one command of `uid` in flight while the block runs."""
    _INFLIGHT[uid] += 1
    try:
        yield
    finally:
        _INFLIGHT[uid] -= 1
        if _INFLIGHT[uid] <= 0:
            del _INFLIGHT[uid]


def normalize_rc(rc: int) -> int:
    # Popen reports death by signal N as -N; shells (and bwrap) report 128+N.
    return 128 - rc if rc < 0 else rc


def spawn(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    with_stdin: bool,
    info_r: int | None,
    info_w: int | None,
) -> subprocess.Popen[bytes]:
    """Start the command as the leader of its own process group, stdout and stderr merged
    into one pipe. `info_w` (bwrap's --info-fd) is passed to it and closed here; on failure
    both ends of that pipe are closed."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            close_fds=True,
            pass_fds=() if info_w is None else (info_w,),
            start_new_session=True,  # own process group: one killpg reaches all of it
        )
    except BaseException:
        for fd in (info_r, info_w):
            if fd is not None:
                os.close(fd)
        raise
    if info_w is not None:
        os.close(info_w)
    return proc


class _Collector(asyncio.Protocol):
    """Keeps the first `cap` bytes and counts (and discards) the rest: draining past the cap
    is what lets the writer finish, and EOF arrive."""

    def __init__(self, cap: int, done: asyncio.Future[None]) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.dropped = 0
        self.done = done

    def data_received(self, data: bytes) -> None:
        room = self.cap - len(self.buf)
        if room > 0:
            self.buf += data[:room]
        self.dropped += max(0, len(data) - max(room, 0))

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


class _StdinProtocol(asyncio.BaseProtocol):
    def __init__(self) -> None:
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


async def _wait_readable(fd: int, timeout: float | None) -> bool:
    """Wait until `fd` (a pidfd) polls readable, i.e. that process has exited. True if it did.
    The reader is removed synchronously on the way out, so a later waiter on the same fd
    cannot lose its registration to a stale callback."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


class Run:
    """One spawned command: its process (the outer wrapper, leader of its own process group),
    output pipe, and for bwrap the sandbox's pid 1 (whose death takes the namespace with it)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        proc: subprocess.Popen[bytes],
        uid: int,
        cap: int,
        info_fd: int | None,
        sweep: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.loop = loop
        self.proc = proc
        self.pid = proc.pid
        self.uid = uid
        self.sweep = sweep
        self.killed = False
        self.finish_task: asyncio.Task[None] | None = None
        self.out_done: asyncio.Future[None] = loop.create_future()
        self.collector = _Collector(cap, self.out_done)
        self.out_transport: asyncio.BaseTransport | None = None
        self.in_transport: asyncio.WriteTransport | None = None
        self.in_protocol = _StdinProtocol()
        self.ns_pidfd: int | None = None
        self.info_fd = info_fd
        self.info_buf = b""
        self.info_done: asyncio.Future[None] = loop.create_future()
        # One future for "the wrapper exited", shared by every waiter: a second add_reader on
        # the same pidfd would silently replace the first waiter's callback.
        self.exit_fut: asyncio.Future[None] = loop.create_future()
        self.poll_task: asyncio.Task[None] | None = None
        self.pidfd: int | None = None
        self._watch_exit()
        self._watch_info()

    def _watch_exit(self) -> None:
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:  # pre-5.3 kernel: fall back to polling
            self.poll_task = self.loop.create_task(self._poll_exit())
        else:
            self.loop.add_reader(self.pidfd, self._on_exit)

    def _watch_info(self) -> None:
        if self.info_fd is None:
            self.info_done.set_result(None)
        else:
            os.set_blocking(self.info_fd, False)
            self.loop.add_reader(self.info_fd, self._read_info)

    # -- bwrap --info-fd: {"child-pid": N, "pid-namespace": I, ...} once the namespace exists
    def _read_info(self) -> None:
        if self.info_fd is None:
            return
        while True:
            try:
                chunk = os.read(self.info_fd, 4096)
            except BlockingIOError:
                return  # more to come
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.info_buf += chunk
        self._close_info()
        pidfd = self._namespace_pidfd()
        if pidfd is None:
            return
        self.ns_pidfd = pidfd
        if self.killed:  # the kill raced the namespace's creation
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)

    def _namespace_pidfd(self) -> int | None:
        """A pidfd of the sandbox's pid 1 from bwrap's report, or None if bwrap failed before
        creating the namespace, or it is already gone. The pid is trusted only once the pidfd
        pins it and it is still in the sandbox's pid namespace (not a reused pid of some
        unrelated process)."""
        try:
            info = json.loads(self.info_buf)
            child, ns = int(info["child-pid"]), int(info["pid-namespace"])
            pidfd = os.pidfd_open(child)
        except (ValueError, KeyError, TypeError, OSError):
            return None
        try:
            if os.stat(f"/proc/{child}/ns/pid").st_ino != ns:
                raise ProcessLookupError
        except OSError:
            os.close(pidfd)
            return None
        return pidfd

    def _close_info(self) -> None:
        if self.info_fd is not None:
            self.loop.remove_reader(self.info_fd)
            os.close(self.info_fd)
            self.info_fd = None
        if not self.info_done.done():
            self.info_done.set_result(None)

    async def start_io(self, stdin: bytes | None) -> None:
        assert self.proc.stdout is not None
        self.out_transport, _ = await self.loop.connect_read_pipe(
            lambda: self.collector, self.proc.stdout
        )
        if stdin is not None:
            assert self.proc.stdin is not None
            tr, self.in_protocol = await self.loop.connect_write_pipe(
                _StdinProtocol, self.proc.stdin
            )
            self.in_transport = tr
            tr.write(stdin)
            tr.close()  # flushes, then closes: the command sees EOF after the data

    def output(self) -> tuple[str, bool]:
        """(the output kept, decoded, with a note if some was dropped; truncated?)"""
        col = self.collector
        text = col.buf.decode("utf-8", errors="replace")
        if col.dropped > 0:
            text += f"\n[... output truncated: {col.dropped} more bytes not shown ...]"
        return text, col.dropped > 0

    def exited(self) -> bool:
        """Has the wrapper exited? Does not reap it (WNOWAIT): while it is an unreaped zombie
        its pid, which is also the process group id, cannot be reused, so killpg stays safe."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def _on_exit(self) -> None:
        if self.pidfd is not None:
            self.loop.remove_reader(self.pidfd)
        if not self.exit_fut.done():
            self.exit_fut.set_result(None)

    async def _poll_exit(self) -> None:
        while not self.exited():
            await asyncio.sleep(0.01)
        self._on_exit()

    async def wait_exit(self, timeout: float | None) -> bool:
        """Wait until the wrapper exits; True if it did."""
        try:
            await asyncio.wait_for(asyncio.shield(self.exit_fut), timeout)
        except TimeoutError:
            return False
        return True

    def kill(self) -> None:
        """Synchronous where possible. bwrap: SIGKILL the namespace's pid 1 (every sandboxed
        process dies with it; the outer bwrap then reaps it and exits). Killing the outer bwrap
        instead would orphan pid 1 to the host's init, a zombie counting against RLIMIT_NPROC
        until that init reaps it. If bwrap has not reported the namespace yet, nothing sandboxed
        runs yet either: _read_info kills it the moment it is reported (_finish waits for that,
        then falls back to the process group). Other modes: the process group."""
        self.killed = True
        self._read_info()  # the report may be waiting in the pipe
        if self.ns_pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.ns_pidfd, signal.SIGKILL)
        elif self.info_done.done():
            self.killpg()

    def killpg(self) -> None:
        # Only while our child is unreaped: then its pid (= pgid) cannot have been reused.
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def ensure_finish(self) -> asyncio.Task[None]:
        if self.finish_task is None:
            self.finish_task = self.loop.create_task(self._finish())
        return self.finish_task

    async def _finish(self) -> None:
        """Make sure nothing of this run is left: the wrapper reaped, the namespace (or, in
        "none" mode, the process group and every process of the uid) dead, pipes closed."""
        try:
            if self.killed:
                await self._stop_killed()
            await self.wait_exit(None)
            await self._reap()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.out_done), _DRAIN_GRACE_S)
        finally:
            self.close()

    async def _stop_killed(self) -> None:
        """After kill(): wait for bwrap's namespace report (then kill() has reached pid 1),
        else, or if bwrap does not exit by itself, kill the process group."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.info_done), _KILL_GRACE_S)
        if self.ns_pidfd is None:
            self.killpg()  # no namespace reported (bwrap failed, or not bwrap)
        if not await self.wait_exit(_KILL_GRACE_S):
            self.killpg()  # bwrap did not go by itself

    async def _reap(self) -> None:
        """The wrapper has exited: reap it, and kill what it may have left behind."""
        # In "none" mode background jobs survive the leader: kill the group before reaping
        # (the zombie pins the pgid), then every process of the uid, setsid escapees too.
        self.killpg()
        self.proc.wait()
        if self.sweep is not None and _INFLIGHT[self.uid] <= 1:
            await self.sweep()
        # bwrap exits only after its pid 1 (and so the whole namespace) is gone: immediate.
        if self.ns_pidfd is not None and not await _wait_readable(self.ns_pidfd, _KILL_GRACE_S):
            log.warning("sandbox of uid %d: pid namespace outlived bwrap", self.uid)

    def close(self) -> None:
        self._close_info()
        if self.out_transport is not None and not self.out_transport.is_closing():
            self.out_transport.close()
        if self.in_transport is not None and not self.in_protocol.lost:
            self.in_transport.abort()  # drop stdin the command never read
        if self.out_transport is None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.in_transport is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.poll_task is not None:
            self.poll_task.cancel()
        for attr in ("pidfd", "ns_pidfd"):
            fd = getattr(self, attr)
            if fd is not None:
                with contextlib.suppress(OSError):
                    self.loop.remove_reader(fd)
                os.close(fd)
                setattr(self, attr, None)
        if not self.out_done.done():
            self.out_done.set_result(None)


async def sweep_uid(argv: list[str]) -> None:
    """Run `kill -KILL -1` as the uid: kills every process of that uid (but itself), including
    those that left the process group with setsid. Once more if it found some, for a process
    forked during the first pass (a task with SIGKILL pending cannot fork, so this suffices);
    killed zombies awaiting the host's init also count as found, hence the small bound."""
    for _ in range(3):
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": INNER_PATH},
            close_fds=True,
        )
        while proc.poll() is None:
            await asyncio.sleep(0.002)
        if proc.returncode != 0:  # ESRCH: nothing left to kill
            return


async def sweep_until_none(kill: Callable[[], int], passes: int = 3) -> None:
    """User mode's sweep: `kill()` (SIGKILL the agent's marked processes, -> how many) again
    while it found some, for a process forked during the pass before, as `sweep_uid`."""
    for _ in range(passes):
        if not await asyncio.to_thread(kill):
            return


async def watch(
    run: Run, workspace: Path, limits: Limits, start: float, baseline: int, check_disk: bool
) -> tuple[bool, bool]:
    """Wait for the command to end. -> (timed out, killed for the workspace size). Where
    `check_disk` (a workspace not on its own size-limited filesystem), the size is checked
    periodically while it runs, so a command cannot fill the disk until its timeout
    (RLIMIT_FSIZE bounds one file only). Overshoot: what it writes in one check interval.
    Killed when over the limit AND bigger than `baseline` (the size the previous command
    left), so that a slow `rm` cleaning up an oversized workspace is not killed; and in any
    case past twice the limit."""
    deadline = start + limits.timeout_s
    if not check_disk:
        return not await run.wait_exit(max(0.0, deadline - time.monotonic())), False
    hard = 2 * limits.workspace_bytes
    interval = _WATCH_MIN_S
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True, False
        if await run.wait_exit(min(remaining, interval)):
            return False, False
        t0 = time.monotonic()
        used = await asyncio.to_thread(disk_usage, workspace, hard)
        if used > hard or (used > limits.workspace_bytes and used > baseline):
            return False, True
        # A big workspace costs a long walk: check it less often (at most ~10% of a core).
        interval = max(_WATCH_MIN_S, 10 * (time.monotonic() - t0))
