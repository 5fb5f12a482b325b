"""Run agent shell commands in a bubblewrap sandbox, one unprivileged host uid per agent.

Design, and what is and is not contained: docs/sandbox.md. In short: bwrap is started *as the
agent's uid* (never as root: a root-started bwrap could remount / read-write), with rlimits set
by `prlimit` in front of it, all namespaces unshared, a read-only view of /usr and a few /etc
files, the workspace bound read-write at /work and private size-limited tmpfs mounts for /tmp
and /dev/shm. No `preexec_fn`/`user=`: plain fork+exec of small wrappers.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

log = logging.getLogger("concur.sandbox")

AGENT_UID_BASE = 200000  # callers use uid = AGENT_UID_BASE + agent_index
PROBE_UID = 199999  # below every agent uid, so a probe never collides with an agent

BASH = "/usr/bin/bash"
INNER_PATH = "/usr/local/bin:/usr/bin:/bin"
# Where the wrappers are looked up: a fixed list, so the caller's PATH cannot pick them.
_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# /etc entries the tools inside need; everything else in /etc (shadow, ssh keys, ...) stays out.
_ETC_FILES = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/ld.so.cache",
    "/etc/alternatives",  # /usr/bin/python3-ish alternatives symlinks point through here
    "/etc/ssl",
    "/etc/localtime",
    "/etc/hosts",  # so "localhost" resolves for servers a test starts inside the sandbox
)
_ETC_GLOBS = ("/etc/python3*",)  # sysconfig / site data of Debian's python3.x
# Top-level usr-merge symlinks (or real dirs on non-merged systems).
_ROOT_LIBDIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_KILL_GRACE_S = 2.0  # after SIGKILL to the namespace, how long bwrap gets to reap it and exit
_DRAIN_GRACE_S = 2.0  # after the process is gone, how long to wait for the output pipe's EOF
_PROBE_TIMEOUT_S = 15.0
# While a command runs, the workspace's size is checked every _WATCH_MIN_S seconds (or 10x the
# time one check took, whichever is longer): past Limits.workspace_bytes the command is killed.
_WATCH_MIN_S = 0.5
_MIN_ENTRY_BYTES = 4096  # what _disk_usage charges at least per file, directory or link


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 60.0  # wall clock; on expiry kill the whole process group / pid namespace
    data_bytes: int = 512 * 2**20  # RLIMIT_DATA (not AS: AS breaks node/java at start)
    cpu_s: int = 120  # RLIMIT_CPU
    nproc: int = 64  # RLIMIT_NPROC (works because the uid is per agent)
    fsize_bytes: int = 16 * 2**20  # RLIMIT_FSIZE (per file; see workspace_bytes)
    nofile: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 32 * 1024  # cap on captured output; the rest is drained and discarded
    tmp_bytes: int = 64 * 2**20  # size of the private tmpfs /tmp (and of /dev/shm)
    workspace_bytes: int = 256 * 2**20  # bound on total workspace size, checked after each command
    # all of one agent's processes together, shared mappings and tmpfs pages included (a
    # memory cgroup per agent uid, where the host has a writable memory controller)
    memory_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"Limits.timeout_s must be > 0, got {self.timeout_s!r}")
        for name in (
            "data_bytes",
            "cpu_s",
            "nproc",
            "fsize_bytes",
            "nofile",
            "tmp_bytes",
            "memory_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.output_bytes < 0 or self.workspace_bytes < 0:
            raise ValueError("Limits.output_bytes and Limits.workspace_bytes must be >= 0")


@dataclass
class ExecResult:
    exit_code: int | None  # None when killed by timeout; 128+N when killed by signal N
    output: str  # stdout+stderr merged, utf-8 (errors="replace"), capped, notes appended
    timed_out: bool
    truncated: bool
    seconds: float
    workspace_over_limit: bool = False  # workspace exceeded workspace_bytes after the command
    killed: str | None = None  # "timeout", or "workspace" (killed while over workspace_bytes)


class SandboxUnavailable(RuntimeError):
    """The requested sandbox cannot run here; the message says why and how to fix it."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=_TOOL_PATH)


def _check_uid(uid: int) -> None:
    # bool is an int; uid 0 would defeat the whole design.
    if isinstance(uid, bool) or not isinstance(uid, int) or not 0 < uid < 2**31 - 1:
        raise ValueError(f"uid must be an unprivileged uid (1 .. 2**31-2), got {uid!r}")


def _prlimit_argv(prlimit: str, limits: Limits) -> list[str]:
    # soft == hard, so the sandboxed code cannot raise them back.
    return [
        prlimit,
        f"--data={limits.data_bytes}",
        f"--cpu={limits.cpu_s}",
        f"--nproc={limits.nproc}",
        f"--fsize={limits.fsize_bytes}",
        f"--nofile={limits.nofile}",
        "--core=0",  # no core dumps landing in the workspace
        "--",
    ]


def _setpriv_argv(setpriv: str, uid: int) -> list[str]:
    # pdeathsig: if this Python process dies, the wrapped command (bwrap) is killed too.
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--pdeathsig=KILL",
        "--",
    ]


def _bwrap_flags(workspace: Path, limits: Limits, workdir: str, env: dict[str, str]) -> list[str]:
    flags = [
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces: only `lo`, own pids
        "--unshare-user",
        "--disable-userns",  # no nested user namespaces (no way to regain capabilities)
        "--die-with-parent",
        "--new-session",  # setsid: no TIOCSTI into a controlling terminal
        # The command is the namespace's pid 1, a direct child of bwrap, which reaps it. With
        # bwrap's own init as pid 1, bwrap exits without reaping that init, and it lingers as a
        # zombie of the host's init (seconds here), still counting against RLIMIT_NPROC.
        "--as-pid-1",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for d in _ROOT_LIBDIRS:
        if os.path.islink(d):
            flags += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            flags += ["--ro-bind", d, d]
    etc = list(_ETC_FILES) + sorted(p for g in _ETC_GLOBS for p in glob.glob(g))
    for p in etc:
        flags += ["--ro-bind-try", p, p]
    flags += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        # bwrap's /dev is an unbounded tmpfs: bound /dev/shm, make the rest read-only.
        "--size",
        str(limits.tmp_bytes),
        "--tmpfs",
        "/dev/shm",
        # No pseudo-terminals: every sandbox's devpts shares one kernel-wide pool (pty.max),
        # which one agent could exhaust for all others.
        "--ro-bind",
        "/dev/null",
        "/dev/pts/ptmx",
        "--remount-ro",
        "/dev",
        "--size",
        str(limits.tmp_bytes),
        "--tmpfs",
        "/tmp",
        "--bind",
        str(workspace),
        workdir,
        "--chdir",
        workdir,
        "--remount-ro",
        "/",
        "--clearenv",
    ]
    for k, v in env.items():
        flags += ["--setenv", k, v]
    return flags


def _inner_env(home: str) -> dict[str, str]:
    return {
        "PATH": INNER_PATH,
        "HOME": home,  # git and friends want a writable HOME; the workspace is the only one
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TMPDIR": "/tmp",
    }


def _normalize_rc(rc: int) -> int:
    # Popen reports death by signal N as -N; shells (and bwrap) report 128+N.
    return 128 - rc if rc < 0 else rc


def _check_traversable(workspace: Path, uid: int) -> None:
    """The uid (with no supplementary groups) must be able to reach the workspace: bwrap opens
    the bind source as that uid, and would otherwise fail with a cryptic message."""
    for parent in workspace.parents:
        st = parent.stat()
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == uid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise PermissionError(
                f"workspace {workspace} is not reachable by sandbox uid {uid}: {parent} "
                f"(mode {stat.filemode(st.st_mode)}) is not searchable by others. Put workspaces "
                f"under a directory with mode 0711 or 0755, or run `chmod o+x {parent}`."
            )


# Directories are opened without following links and without blocking: anything an agent
# swaps in for a directory (a symlink, a FIFO, a device) fails to open instead of steering or
# hanging a root thread.
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
WALK_MAX_ENTRIES = 200_000  # past this a workspace counts as over its size limit
WALK_MAX_DEPTH = 256


class WalkLimit(OSError):
    """A workspace too large (entries) or too deep to walk safely."""


def _walk(root: Path) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry under root as (parent dir fd, name, lstat), depth first and iterative
    (no recursion limit to hit), at most WALK_MAX_DEPTH directories open at once."""
    fd = os.open(root, _OPEN_DIR)
    stack: list[tuple[int, Iterator[os.DirEntry[str]]]] = [(fd, os.scandir(fd))]
    n = 0
    try:
        while stack:
            fd, it = stack[-1]
            entry = next(it, None)
            if entry is None:
                stack.pop()
                it.close()  # type: ignore[attr-defined]
                os.close(fd)
                continue
            try:
                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            n += 1
            if n > WALK_MAX_ENTRIES:
                raise WalkLimit(f"{root}: more than {WALK_MAX_ENTRIES} entries")
            yield fd, entry.name, st
            if stat.S_ISDIR(st.st_mode):
                if len(stack) >= WALK_MAX_DEPTH:
                    raise WalkLimit(f"{root}: nested deeper than {WALK_MAX_DEPTH} directories")
                try:
                    sub = os.open(entry.name, _OPEN_DIR, dir_fd=fd)
                except OSError:  # removed or swapped for a non-directory meanwhile
                    continue
                stack.append((sub, os.scandir(sub)))
    finally:
        for fd, it in stack:
            it.close()  # type: ignore[attr-defined]
            os.close(fd)


def _chown_tree(root: Path, uid: int) -> None:
    # dir fds + follow_symlinks=False: symlinks planted in the workspace are never followed,
    # so this root-run chown cannot be steered at files outside it.
    os.chown(root, uid, uid, follow_symlinks=False)
    for dirfd, name, st in _walk(root):
        if st.st_uid == uid and st.st_gid == uid:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            # A hard link may point at a file outside the workspace: leave it alone.
            log.warning("not chowning hard-linked file %s in %s", name, root)
            continue
        os.chown(name, uid, uid, dir_fd=dirfd, follow_symlinks=False)


def _disk_usage(root: Path, limit: int) -> int:
    """Bytes allocated under root (du-like, symlinks not followed; every name, hard links
    included, costs at least one block, so masses of empty files or links count too). Stops
    early once past `limit + 1`: the caller only needs to know whether it is over. A tree
    too big or too deep to walk counts as over."""
    total = 0
    seen: set[tuple[int, int]] = set()
    try:
        for _fd, _name, st in _walk(root):
            blocks = st.st_blocks * 512
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    blocks = 0  # its data is counted once; the name still costs a block
                seen.add(key)
            total += max(blocks, _MIN_ENTRY_BYTES)
            if total > limit:
                break
    except WalkLimit:
        return limit + 1
    except FileNotFoundError:
        pass
    return total


def remove_tree(path: Path) -> None:
    """Delete a workspace tree as root, safely: GNU rm never follows symlinks, stays on one
    filesystem and has no recursion limit (shutil.rmtree in 3.11 recurses: a deep tree made by
    an agent raises RecursionError). Missing paths are fine; failures are logged."""
    if not os.path.lexists(path):
        return
    r = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        log.warning("could not remove %s: %s", path, r.stderr.strip()[:500])


def move_tree(src: Path, dst: Path) -> None:
    """Move a workspace tree as root without letting it gain anything: a rename on the same
    filesystem; across filesystems `cp -a` (owners stay the agent's uid, never root; hard
    links, holes and symlinks kept as they are, never followed), then the source removed.
    shutil.move would copy as root: setuid files would become root-owned, links expanded."""
    remove_tree(dst)
    if os.stat(src.parent).st_dev == os.stat(dst.parent).st_dev:
        os.rename(src, dst)
        return
    r = subprocess.run(
        ["cp", "-a", "--one-file-system", "--", str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise OSError(f"could not copy {src} to {dst}: {r.stderr.strip()[:500]}")
    remove_tree(src)


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if x < 1024 or unit == "GiB":
            break
    return f"{x:.1f} {unit}"


# Commands in flight per uid, across all Sandbox instances of this process: the "none" mode
# sweep (kill every process of the uid) must not hit a sibling command of the same agent.
_INFLIGHT: Counter[int] = Counter()


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


class _Run:
    """One spawned command: its process (the outer wrapper, leader of its own process group),
    output pipe, and for bwrap the sandbox's pid 1 (whose death takes the namespace with it)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        proc: subprocess.Popen[bytes],
        uid: int,
        cap: int,
        info_fd: int | None,
        sweep_argv: list[str] | None,
    ) -> None:
        self.loop = loop
        self.proc = proc
        self.pid = proc.pid
        self.uid = uid
        self.sweep_argv = sweep_argv
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
        self.pidfd: int | None
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:  # pre-5.3 kernel: fall back to polling
            self.pidfd = None
            self.poll_task = loop.create_task(self._poll_exit())
        else:
            loop.add_reader(self.pidfd, self._on_exit)
        if info_fd is None:
            self.info_done.set_result(None)
        else:
            os.set_blocking(info_fd, False)
            loop.add_reader(info_fd, self._read_info)

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
        try:
            info = json.loads(self.info_buf)
            child, ns = int(info["child-pid"]), int(info["pid-namespace"])
            pidfd = os.pidfd_open(child)
        except (ValueError, KeyError, TypeError, OSError):
            return  # bwrap failed before creating the namespace, or it is already gone
        try:
            # Trust the pid only once the pidfd pins it and it is still in the sandbox's pid
            # namespace (not a reused pid of some unrelated process).
            if os.stat(f"/proc/{child}/ns/pid").st_ino != ns:
                raise ProcessLookupError
        except OSError:
            os.close(pidfd)
            return
        self.ns_pidfd = pidfd
        if self.killed:  # the kill raced the namespace's creation
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)

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
        """Wait until the wrapper exits; True if it did. Not via asyncio's child watchers,
        whose wait() can hang while an escaped grandchild holds a pipe."""
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.info_done), _KILL_GRACE_S)
                if self.ns_pidfd is None:
                    self.killpg()  # no namespace reported (bwrap failed, or not bwrap)
                if not await self.wait_exit(_KILL_GRACE_S):
                    self.killpg()  # bwrap did not go by itself
            await self.wait_exit(None)
            # In "none" mode background jobs survive the leader: kill the group before reaping
            # (the zombie pins the pgid), then every process of the uid, setsid escapees too.
            self.killpg()
            self.proc.wait()
            if self.sweep_argv is not None and _INFLIGHT[self.uid] <= 1:
                await _sweep_uid(self.sweep_argv)
            # bwrap exits only after its pid 1 (and so the whole namespace) is gone: immediate.
            if self.ns_pidfd is not None and not await _wait_readable(self.ns_pidfd, _KILL_GRACE_S):
                log.warning("sandbox of uid %d: pid namespace outlived bwrap", self.uid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.out_done), _DRAIN_GRACE_S)
        finally:
            self.close()

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


async def _sweep_uid(argv: list[str]) -> None:
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


async def _watch(
    run: _Run, workspace: Path, limits: Limits, start: float, baseline: int
) -> tuple[bool, bool]:
    """Wait for the command to end. -> (timed out, killed for the workspace size): the size is
    checked periodically while it runs, so a command cannot fill the disk until its timeout
    (RLIMIT_FSIZE bounds one file only). Overshoot: what it writes in one check interval.
    Killed when over the limit AND bigger than `baseline` (the size the previous command
    left), so that a slow `rm` cleaning up an oversized workspace is not killed; and in any
    case past twice the limit."""
    deadline = start + limits.timeout_s
    hard = 2 * limits.workspace_bytes
    interval = _WATCH_MIN_S
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True, False
        if await run.wait_exit(min(remaining, interval)):
            return False, False
        t0 = time.monotonic()
        used = await asyncio.to_thread(_disk_usage, workspace, hard)
        if used > hard or (used > limits.workspace_bytes and used > baseline):
            return False, True
        # A big workspace costs a long walk: check it less often (at most ~10% of a core).
        interval = max(_WATCH_MIN_S, 10 * (time.monotonic() - t0))


_CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")  # the cgroup v1 memory controller


class _MemoryCgroups:
    """One memory cgroup per agent uid: bounds the agent's processes together, shared
    mappings and tmpfs pages included, which rlimits cannot (RLIMIT_DATA ignores
    MAP_SHARED). The command places itself in it before exec, so its whole tree is inside.
    Without a writable memory controller (cgroup v1 here) this is off, said once."""

    def __init__(self) -> None:
        self.root: Path | None = None
        try:
            if (_CGROUP_MEMORY / "memory.limit_in_bytes").exists() and os.access(
                _CGROUP_MEMORY, os.W_OK
            ):
                _remove_stale_cgroups()
                root = _CGROUP_MEMORY / f"concur-{os.getpid()}"
                root.mkdir(exist_ok=True)
                self.root = root
                atexit.register(self.close)
        except OSError as e:
            log.warning("no memory cgroups (%s): agents' total memory is not bounded", e)
        if self.root is None:
            log.warning(
                "no writable cgroup v1 memory controller at %s: each agent's total memory "
                "(shared mappings included) is not bounded, only per-process data size",
                _CGROUP_MEMORY,
            )

    def procs_file(self, uid: int, limit: int) -> str | None:
        if self.root is None:
            return None
        d = self.root / f"u{uid}"
        if not d.exists():
            d.mkdir(parents=True)
            (d / "memory.limit_in_bytes").write_text(str(limit))
            swap = d / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swap beyond the limit either
                swap.write_text(str(limit))
        return str(d / "cgroup.procs")

    def close(self) -> None:
        if self.root is None:
            return
        for d in self.root.glob("u*"):
            with contextlib.suppress(OSError):  # a group still in use stays
                d.rmdir()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def _remove_stale_cgroups() -> None:
    """Groups left by runner processes that are gone (killed before they could clean up)."""
    for d in _CGROUP_MEMORY.glob("concur-*"):
        pid = d.name.removeprefix("concur-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            for sub in d.glob("u*"):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()


_CGROUPS: _MemoryCgroups | None = None  # one per process, made on first use


def _cgroup_prefix(uid: int, limits: Limits) -> list[str]:
    """argv that puts the command in its agent's memory cgroup, then execs the rest."""
    global _CGROUPS
    if _CGROUPS is None:
        _CGROUPS = _MemoryCgroups()
    procs = _CGROUPS.procs_file(uid, limits.memory_bytes)
    return [] if procs is None else ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs]


class Sandbox:
    """Runs `bash -c command` for one agent (one uid) in its workspace. Subclasses say how."""

    mode: ClassVar[str] = ""
    WORKDIR: ClassVar[str] = ""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "the sandbox must be started as root: it drops every command to a per-agent "
                "uid with setpriv (CAP_SETUID needed). Run the runner as root."
            )
        tools = {n: _which(n) for n in ("prlimit", "setpriv")}
        missing = [n for n, p in tools.items() if p is None]
        if missing or not os.access(BASH, os.X_OK):
            raise SandboxUnavailable(
                f"missing {', '.join(missing) or BASH}: install util-linux and bash "
                "(apt-get install -y util-linux bash)."
            )
        self._prlimit: str = tools["prlimit"]  # type: ignore[assignment]
        self._setpriv: str = tools["setpriv"]  # type: ignore[assignment]
        self._runs: set[_Run] = set()
        # Size of each workspace after its last command (exact up to 2x its limit).
        self._ws_usage: dict[Path, int] = {}

    def workdir(self, workspace: Path) -> str:
        """The path the command sees as its cwd for this workspace."""
        return self.WORKDIR

    def prepare_workspace(self, workspace: Path, uid: int) -> None:
        """mkdir -p, chown -R uid:uid, mode 0700. Call once per agent, before its commands."""
        _check_uid(uid)
        workspace = Path(workspace).resolve()
        workspace.mkdir(parents=True, exist_ok=True)
        _check_traversable(workspace, uid)
        _chown_tree(workspace, uid)
        os.chmod(workspace, 0o700)

    def _argv(
        self, command: str, workspace: Path, uid: int, limits: Limits, info_fd: int | None
    ) -> tuple[list[str], str, dict[str, str]]:
        """(argv, cwd for the spawn, env for the spawn)."""
        raise NotImplementedError

    def _sweep_argv(self, uid: int) -> list[str] | None:
        return None

    _uses_info_fd: ClassVar[bool] = False

    async def run(
        self,
        command: str,
        workspace: Path,
        uid: int,
        limits: Limits = Limits(),
        stdin: str | None = None,
    ) -> ExecResult:
        _check_uid(uid)
        workspace = Path(workspace).resolve()
        if not workspace.is_dir():
            raise FileNotFoundError(
                f"workspace {workspace} does not exist; call prepare_workspace() first"
            )
        loop = asyncio.get_running_loop()
        info_r = info_w = None
        if self._uses_info_fd:
            info_r, info_w = os.pipe()
        argv, cwd, env = self._argv(command, workspace, uid, limits, info_w)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
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
        run = _Run(loop, proc, uid, limits.output_bytes, info_r, self._sweep_argv(uid))
        self._runs.add(run)
        _INFLIGHT[uid] += 1
        try:
            try:
                await run.start_io(None if stdin is None else stdin.encode())
                baseline = self._ws_usage.get(workspace, 0)
                timed_out, disk_kill = await _watch(run, workspace, limits, start, baseline)
                if timed_out or disk_kill:
                    run.kill()
                await run.ensure_finish()
            except BaseException:
                # Cancelled (or anything else): kill synchronously, before the exception
                # propagates, then let the teardown finish even if cancelled again.
                run.kill()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.shield(run.ensure_finish())
                raise
        finally:
            _INFLIGHT[uid] -= 1
            if _INFLIGHT[uid] <= 0:
                del _INFLIGHT[uid]
            self._runs.discard(run)
        seconds = time.monotonic() - start

        col = run.collector
        output = col.buf.decode("utf-8", errors="replace")
        truncated = col.dropped > 0
        if truncated:
            output += f"\n[... output truncated: {col.dropped} more bytes not shown ...]"
        used = await asyncio.to_thread(_disk_usage, workspace, 2 * limits.workspace_bytes)
        self._ws_usage[workspace] = used
        over = used > limits.workspace_bytes or disk_kill
        if disk_kill:
            output += (
                f"\n[killed: the workspace grew past its size limit of "
                f"{_human(limits.workspace_bytes)} while the command ran; delete files to get "
                "back under it]"
            )
        elif over:
            output += (
                f"\n[workspace over its size limit: more than {_human(used)} used, limit "
                f"{_human(limits.workspace_bytes)}; delete files to get back under it]"
            )
        rc = proc.returncode
        return ExecResult(
            exit_code=None if timed_out or disk_kill or rc is None else _normalize_rc(rc),
            output=output,
            timed_out=timed_out,
            truncated=truncated,
            seconds=seconds,
            workspace_over_limit=over,
            killed="timeout" if timed_out else "workspace" if disk_kill else None,
        )

    async def aclose(self) -> None:
        """Kill every command of this sandbox still running and wait for their teardown;
        remove the agents' (now empty) memory cgroups."""
        runs = list(self._runs)
        for r in runs:
            r.kill()
        if runs:
            await asyncio.gather(*(r.ensure_finish() for r in runs), return_exceptions=True)
        if _CGROUPS is not None:
            _CGROUPS.close()


class BwrapSandbox(Sandbox):
    mode: ClassVar[str] = "bwrap"
    WORKDIR: ClassVar[str] = "/work"
    _uses_info_fd: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        bwrap = _which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(_unavailable_message("bwrap is not installed"))
        self._bwrap = bwrap

    def _argv(
        self, command: str, workspace: Path, uid: int, limits: Limits, info_fd: int | None
    ) -> tuple[list[str], str, dict[str, str]]:
        argv = [
            *_cgroup_prefix(uid, limits),
            *_prlimit_argv(self._prlimit, limits),
            *_setpriv_argv(self._setpriv, uid),
            self._bwrap,
            *_bwrap_flags(workspace, limits, self.WORKDIR, _inner_env(self.WORKDIR)),
        ]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]
        argv += ["--", BASH, "-c", command]
        # The wrappers start in "/"; the command's cwd comes from --chdir.
        return argv, "/", {"PATH": INNER_PATH}


class UnsandboxedSandbox(Sandbox):
    """Mode "none": rlimits, per-agent uid, own session and process-group kill, but NO
    filesystem or network isolation. After each command every process of the uid is killed
    (unless another command of the same uid is still running)."""

    mode: ClassVar[str] = "none"
    WORKDIR: ClassVar[str] = "."  # the real path depends on the workspace: see workdir()

    def __init__(self) -> None:
        super().__init__()
        self._kill = _which("kill")
        log.warning(
            "SANDBOX DISABLED (--sandbox none): agent commands run on the host without "
            "filesystem or network isolation, only as a per-agent uid with rlimits. They can "
            "read any world-readable file, reach the network and local services. Use only for "
            "trusted workloads; install bubblewrap (apt-get install -y bubblewrap) to isolate."
        )

    def workdir(self, workspace: Path) -> str:
        return str(Path(workspace).resolve())

    def _argv(
        self, command: str, workspace: Path, uid: int, limits: Limits, info_fd: int | None
    ) -> tuple[list[str], str, dict[str, str]]:
        argv = [
            *_cgroup_prefix(uid, limits),
            *_prlimit_argv(self._prlimit, limits),
            *_setpriv_argv(self._setpriv, uid),
            BASH,
            "-c",
            command,
        ]
        return argv, str(workspace), _inner_env(str(workspace))

    def _sweep_argv(self, uid: int) -> list[str] | None:
        # No prlimit here: the sweep must work even while the uid is at its nproc limit.
        killer = [self._kill, "-KILL", "-1"] if self._kill else [BASH, "-c", "kill -KILL -1"]
        return [
            self._setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
            *killer,
        ]


def _unavailable_message(reason: str) -> str:
    return (
        f"bubblewrap sandbox unavailable: {reason}. Fix: install it with "
        "`apt-get install -y bubblewrap` and make sure unprivileged user namespaces are "
        "enabled (sysctl user.max_user_namespaces > 0; on Debian/Ubuntu also "
        "kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0), "
        "or run with `--sandbox none` (no filesystem/network isolation; not recommended)."
    )


def probe_bwrap() -> str | None:
    """Run a tiny real sandboxed command, as an unprivileged uid with the production flags.
    None if it works, else the reason."""
    try:
        sb = BwrapSandbox()
    except SandboxUnavailable as e:
        return str(e)  # already says what is missing and how to fix it
    # /tmp rather than $TMPDIR: the probe uid must be able to reach the directory.
    tmp = Path(
        tempfile.mkdtemp(prefix="sandbox-probe-", dir="/tmp" if os.path.isdir("/tmp") else None)
    )
    try:
        os.chmod(tmp, 0o711)
        ws = tmp / "ws"
        sb.prepare_workspace(ws, PROBE_UID)
        check = 'test "$PWD" = /work && touch /work/probe && ! touch /etc/probe 2>/dev/null'
        argv, cwd, env = sb._argv(check, ws, PROBE_UID, Limits(), None)
        try:
            p = subprocess.run(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=_PROBE_TIMEOUT_S,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return f"sandboxed probe command did not finish within {_PROBE_TIMEOUT_S:g}s"
        if p.returncode != 0:
            out = p.stdout.decode("utf-8", errors="replace").strip()
            return f"sandboxed probe command failed (exit {p.returncode}): {out or 'no output'}"
        if not (ws / "probe").is_file():
            return "sandboxed probe command did not write to its workspace"
        return None
    except OSError as e:
        return f"sandbox probe failed: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


MODES = ("bwrap", "none")


def make_sandbox(mode: str) -> Sandbox:
    if mode == "bwrap":
        sb = BwrapSandbox()  # raises SandboxUnavailable itself when not root / not installed
        reason = probe_bwrap()
        if reason is not None:
            raise SandboxUnavailable(_unavailable_message(reason))
        return sb
    if mode == "none":
        return UnsandboxedSandbox()
    raise ValueError(f"unknown sandbox mode {mode!r}; valid modes: {', '.join(MODES)}")
