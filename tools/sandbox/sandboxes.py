"""The sandboxes: `Sandbox.run` runs one `bash -c command` for one agent (one uid) in its
workspace and returns an ExecResult; the subclasses say how it is wrapped (bwrap, or mode
"none": rlimits and the uid only). Each works in root mode (every agent its own host uid) or,
started by an ordinary user, in user mode (agents run as that user: bwrap in an unprivileged
user namespace per command; the uid numbers only label agents). `make_sandbox(mode)` is how
the runner gets one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

from . import cgroups
from .bwrap import (
    BASH,
    INNER_PATH,
    Wrapping,
    bwrap_argv,
    find_bwrap,
    host_wrappers,
    inner_env,
    prepare_own_tree,
    prlimit_argv,
    probe_bwrap,
    setpriv_argv,
    unavailable_message,
    which,
)
from .cgroups import cgroup_prefix, close_cgroups
from .filesystem import disk_usage, prepare_tree
from .limits import ExecResult, Limits, SandboxUnavailable, check_uid
from .processes import Run, inflight, normalize_rc, spawn, sweep_uid, sweep_until_none, watch
from .reaper import AGENT_MARK, MARK, kill_marked, run_mark
from .workspaces import WorkspaceBound, space, workspace_bound

log = logging.getLogger("concur.sandbox")

# bwrap: root mode as root, user mode otherwise; bwrap-root / bwrap-user: that one or an error
MODES = ("bwrap", "bwrap-root", "bwrap-user", "none")
_DEFAULT_LIMITS = Limits()  # a frozen dataclass: safe to share as a default


class Sandbox:
    """Runs `bash -c command` for one agent (one uid) in its workspace. Subclasses say how."""

    mode: ClassVar[str] = ""
    WORKDIR: ClassVar[str] = ""
    _uses_info_fd: ClassVar[bool] = False  # bwrap reports its pid namespace on an extra fd

    def __init__(self, user: bool | None = None) -> None:
        # user mode: started by an ordinary user, every agent runs as that user
        self.user = os.geteuid() != 0 if user is None else user
        if self.user and os.geteuid() == 0:
            raise SandboxUnavailable(
                "user mode runs every agent as the user who starts the runner; as root that "
                "is uid 0 on the host. Run it as an ordinary user, or as root in root mode"
            )
        self._wrappers = host_wrappers(self.user)  # (prlimit, setpriv); SandboxUnavailable
        self._mark = run_mark()  # in every command's environment: the reaper's way to them
        cgroups.in_force()  # look for the agents' cgroups now (said once if there are none)
        self._runs: set[Run] = set()
        # Size of each workspace after its last command (exact up to 2x its limit).
        self._ws_usage: dict[Path, int] = {}

    def workdir(self, workspace: Path) -> str:
        """The path the command sees as its cwd for this workspace."""
        return self.WORKDIR

    @property
    def privilege(self) -> str:
        """Root mode (a host uid per agent) or user mode (agents run as the user)."""
        return "user" if self.user else "root"

    def prepare_workspace(self, workspace: Path, uid: int) -> None:
        """mkdir -p, chown -R uid:uid (root mode), mode 0700. Call once per agent, before its
        commands."""
        if self.user:
            check_uid(uid)
            prepare_own_tree(workspace)
        else:
            prepare_tree(workspace, uid)

    def _argv(
        self, command: str, workspace: Path, uid: int, limits: Limits, info_fd: int | None
    ) -> tuple[list[str], str, dict[str, str]]:
        """(argv, cwd for the spawn, env for the spawn)."""
        raise NotImplementedError

    def _sweep(self, uid: int) -> Callable[[], Awaitable[None]] | None:
        """What kills a command's escapees once it is done (None: its namespace did)."""
        return None

    async def run(
        self,
        command: str,
        workspace: Path,
        uid: int,
        limits: Limits = _DEFAULT_LIMITS,
        stdin: str | None = None,
    ) -> ExecResult:
        check_uid(uid)
        workspace = Path(workspace).resolve()
        if not workspace.is_dir():
            raise FileNotFoundError(
                f"workspace {workspace} does not exist; call prepare_workspace() first"
            )
        # On its own filesystem the workspace cannot outgrow its limit: no watch needed.
        bound = workspace_bound(workspace)
        loop = asyncio.get_running_loop()
        info_r, info_w = os.pipe() if self._uses_info_fd else (None, None)
        argv, cwd, env = self._argv(command, workspace, uid, limits, info_w)
        start = time.monotonic()
        proc = spawn(argv, cwd, env, stdin is not None, info_r, info_w)
        run = Run(loop, proc, uid, limits.output_bytes, info_r, self._sweep(uid))
        self._runs.add(run)
        try:
            with inflight(uid):
                timed_out, disk_kill = await self._supervise(
                    run, workspace, limits, start, stdin, bound is None
                )
        finally:
            self._runs.discard(run)
        seconds = time.monotonic() - start
        if bound is not None:
            return self._bounded_result(run, workspace, bound, limits, timed_out, seconds)
        return await self._result(run, workspace, limits, timed_out, disk_kill, seconds)

    async def _supervise(
        self,
        run: Run,
        workspace: Path,
        limits: Limits,
        start: float,
        stdin: str | None,
        check_disk: bool,
    ) -> tuple[bool, bool]:
        """Feed stdin, wait for the end (or the timeout, or, where `check_disk`, the workspace
        limit), tear down. -> (timed out, killed for the workspace size)."""
        try:
            await run.start_io(None if stdin is None else stdin.encode())
            baseline = self._ws_usage.get(workspace, 0)
            timed_out, disk_kill = await watch(run, workspace, limits, start, baseline, check_disk)
            if timed_out or disk_kill:
                run.kill()
            await run.ensure_finish()
            return timed_out, disk_kill
        except BaseException:
            # Cancelled (or anything else): kill synchronously, before the exception
            # propagates, then let the teardown finish even if cancelled again.
            run.kill()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(run.ensure_finish())
            raise

    async def _result(
        self,
        run: Run,
        workspace: Path,
        limits: Limits,
        timed_out: bool,
        disk_kill: bool,
        seconds: float,
    ) -> ExecResult:
        output, truncated = run.output()
        used = await asyncio.to_thread(disk_usage, workspace, 2 * limits.workspace_bytes)
        self._ws_usage[workspace] = used
        over = used > limits.workspace_bytes or disk_kill
        notes = _workspace_note(used, limits, disk_kill, over)
        rc = run.proc.returncode
        return ExecResult(
            exit_code=None if timed_out or disk_kill or rc is None else normalize_rc(rc),
            output=output + notes,
            timed_out=timed_out,
            truncated=truncated,
            seconds=seconds,
            workspace_over_limit=over,
            killed="timeout" if timed_out else "workspace" if disk_kill else None,
            notes=notes,
        )

    def _bounded_result(
        self,
        run: Run,
        workspace: Path,
        bound: WorkspaceBound,
        limits: Limits,
        timed_out: bool,
        seconds: float,
    ) -> ExecResult:
        """The result of a command in a workspace on its own size-limited filesystem: its usage
        read from that filesystem, and a note when it is full or a write ran out of space."""
        output, truncated = run.output()
        used, free = space(workspace, bound)
        full = free < max(_FULL_SLACK, bound.limit // 100)
        notes = _bound_note(output, used, free, bound, limits, full)
        rc = run.proc.returncode
        return ExecResult(
            exit_code=None if timed_out or rc is None else normalize_rc(rc),
            output=output + notes,
            timed_out=timed_out,
            truncated=truncated,
            seconds=seconds,
            workspace_over_limit=used > bound.limit,  # only root's setup could get it there
            killed="timeout" if timed_out else None,
            workspace_full=full,
            notes=notes,
        )

    async def aclose(self) -> None:
        """Kill every command of this sandbox still running and wait for their teardown;
        remove the agents' (now empty) memory cgroups."""
        runs = list(self._runs)
        for r in runs:
            r.kill()
        if runs:
            await asyncio.gather(*(r.ensure_finish() for r in runs), return_exceptions=True)
        close_cgroups()


def _workspace_note(used: int, limits: Limits, disk_kill: bool, over: bool) -> str:
    if disk_kill:
        return (
            f"\n[killed: the workspace grew past its size limit of "
            f"{_human(limits.workspace_bytes)} while the command ran; delete files to get "
            "back under it]"
        )
    if over:
        return (
            f"\n[workspace over its size limit: more than {_human(used)} used, limit "
            f"{_human(limits.workspace_bytes)}; delete files to get back under it]"
        )
    return ""


_FULL_SLACK = 64 * 1024  # a workspace with less free space than this (or 1%) is full
_ENOSPC = "No space left on device"  # strerror(ENOSPC), what tools print on it


def _bound_note(
    output: str, used: int, free: int, bound: WorkspaceBound, limits: Limits, full: bool
) -> str:
    if full:
        return (
            f"\n[workspace full: {_human(used)} used of its {_human(bound.limit)} limit (its own "
            f"{bound.fs} filesystem); writes there fail with '{_ENOSPC}' until files are "
            "deleted]"
        )
    if _ENOSPC in output:  # a write bigger than what is left, or /tmp full
        return (
            f"\n[a write ran out of space: the workspace is limited to {_human(bound.limit)} "
            f"({_human(used)} used, {_human(free)} free), /tmp and /dev/shm to "
            f"{_human(limits.tmp_bytes)} each]"
        )
    return ""


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        x /= 1024
        if x < 1024 or unit == "GiB":
            break
    return f"{x:.1f} {unit}"


class BwrapSandbox(Sandbox):
    mode: ClassVar[str] = "bwrap"
    WORKDIR: ClassVar[str] = "/work"
    _uses_info_fd: ClassVar[bool] = True

    def __init__(self, user: bool | None = None) -> None:
        if user and os.geteuid() == 0:
            raise SandboxUnavailable(
                "--sandbox bwrap-user runs every agent as the user who starts the runner; "
                "as root that is uid 0 on the host. Run it as an ordinary user, or use "
                "--sandbox bwrap (root mode: a uid per agent)"
            )
        super().__init__(user)
        self._bwrap = find_bwrap()
        self._how = Wrapping(user=self.user, mark=self._mark)
        if self.user:
            self._how = self._probe_user_mode()

    def _probe_user_mode(self) -> Wrapping:
        """User mode: the per-command process bound (RLIMIT_NPROC inside each sandbox) needs
        a kernel that counts it per user namespace; else one bound for the whole batch."""
        inside = Wrapping(user=True, nproc_inside=True, mark=self._mark)
        inside_failed = probe_bwrap(inside)
        if inside_failed is None:
            return inside
        reason = probe_bwrap(self._how)
        if reason is not None:
            raise SandboxUnavailable(unavailable_message(reason))
        log.warning(
            "RLIMIT_NPROC inside the sandbox failed (%s; a kernel before Linux 5.14 counts it "
            "per user, not per user namespace): no per-agent process bound; all of uid %d's "
            "processes share its limit",
            inside_failed.strip(),
            os.geteuid(),
        )
        return self._how

    @property
    def nproc_inside(self) -> bool:
        return self._how.nproc_inside

    def _argv(
        self, command: str, workspace: Path, uid: int, limits: Limits, info_fd: int | None
    ) -> tuple[list[str], str, dict[str, str]]:
        argv = bwrap_argv(
            self._wrappers,
            self._bwrap,
            command,
            workspace,
            uid,
            limits,
            info_fd,
            self.WORKDIR,
            how=self._how,
        )
        # The wrappers start in "/"; the command's cwd comes from --chdir.
        return argv, "/", {"PATH": INNER_PATH, MARK: self._mark}


class UnsandboxedSandbox(Sandbox):
    """Mode "none": rlimits, per-agent uid (root), own session and process-group kill, but NO
    filesystem or network isolation. After each command every process of the uid is killed
    (unless another command of the same uid is still running); in user mode, every process
    that carries the agent's mark in its environment."""

    mode: ClassVar[str] = "none"
    WORKDIR: ClassVar[str] = "."  # the real path depends on the workspace: see workdir()

    def __init__(self, user: bool | None = None) -> None:
        super().__init__(user)
        self._kill = which("kill")
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
        prlimit, setpriv = self._wrappers
        argv = [
            *cgroup_prefix(uid, limits),
            *prlimit_argv(prlimit, limits, nproc=not self.user),
            *setpriv_argv(setpriv, None if self.user else uid),
            BASH,
            "-c",
            command,
        ]
        env = inner_env(str(workspace), self._mark)
        if self.user:
            env[AGENT_MARK] = str(uid)
        return argv, str(workspace), env

    def _sweep(self, uid: int) -> Callable[[], Awaitable[None]] | None:
        if self.user:  # never `kill -1` as the user: that would kill the runner too
            agent = {MARK.encode(): self._mark.encode(), AGENT_MARK.encode(): str(uid).encode()}

            def ours(env: dict[bytes, bytes]) -> bool:
                return all(env.get(k) == v for k, v in agent.items())

            return lambda: sweep_until_none(lambda: kill_marked(ours))
        # No prlimit here: the sweep must work even while the uid is at its nproc limit.
        killer = [self._kill, "-KILL", "-1"] if self._kill else [BASH, "-c", "kill -KILL -1"]
        argv = [
            self._wrappers[1],
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
            *killer,
        ]
        return lambda: sweep_uid(argv)


def make_sandbox(mode: str) -> Sandbox:
    if mode in ("bwrap", "bwrap-root", "bwrap-user"):
        # raises SandboxUnavailable itself when not installed, or not root for bwrap-root;
        # user mode has probed already
        sb = BwrapSandbox({"bwrap": None, "bwrap-root": False, "bwrap-user": True}[mode])
        reason = None if sb.user else probe_bwrap(Wrapping())
        if reason is not None:
            raise SandboxUnavailable(unavailable_message(reason))
        return sb
    if mode == "none":
        return UnsandboxedSandbox()
    raise ValueError(f"unknown sandbox mode {mode!r}; valid modes: {', '.join(MODES)}")
