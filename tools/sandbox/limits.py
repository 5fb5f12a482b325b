"""What a command may use (Limits), what it gave back (ExecResult), and the uid rules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

AGENT_UID_BASE = 200000  # callers use uid = AGENT_UID_BASE + agent_index
PROBE_UID = 199999  # below every agent uid, so a probe never collides with an agent


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 60.0  # wall clock; on expiry kill the whole process group / pid namespace
    data_bytes: int = 512 * 2**20  # RLIMIT_DATA (not AS: AS breaks node/java at start)
    cpu_s: int = 120  # RLIMIT_CPU
    # RLIMIT_NPROC, per agent: root mode gives each agent its own uid; user mode sets it
    # inside each sandbox's user namespace (docs/sandbox.md)
    nproc: int = 64
    fsize_bytes: int = 16 * 2**20  # RLIMIT_FSIZE (per file; see workspace_bytes)
    nofile: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 32 * 1024  # cap on captured output; the rest is drained and discarded
    tmp_bytes: int = 64 * 2**20  # size of the private tmpfs /tmp (and of /dev/shm)
    # bound on total workspace size: exact where the workspace is its own filesystem
    # (workspaces.make_workspace), else checked while each command runs and after it
    workspace_bytes: int = 256 * 2**20
    # all of one agent's processes together, shared mappings and tmpfs pages included (a
    # memory cgroup per agent: v1 per agent uid as root, v2 in our own or a delegated
    # subtree; docs/sandbox.md says where none is)
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
    # the workspace's own filesystem is (nearly) full: writes fail with ENOSPC at its limit
    workspace_full: bool = False
    # the sandbox's notes at the end of `output` (workspace size): output[:len(output) -
    # len(notes)] is what the command itself wrote
    notes: str = ""


class SandboxUnavailable(RuntimeError):
    """The requested sandbox cannot run here; the message says why and how to fix it."""


def check_uid(uid: int) -> None:
    # bool is an int; uid 0 would defeat the whole design.
    if isinstance(uid, bool) or not isinstance(uid, int) or not 0 < uid < 2**31 - 1:
        raise ValueError(f"uid must be an unprivileged uid (1 .. 2**31-2), got {uid!r}")


class CommandSandbox(Protocol):
    """What tools and the batch need of a sandbox: `Sandbox` (sandboxes.py) implements it;
    so does the simulator's, which runs no commands."""

    @property
    def mode(self) -> str: ...

    def prepare_workspace(self, workspace: Path, uid: int) -> None: ...

    def workdir(self, workspace: Path) -> str:
        """The path a command sees as its cwd for this workspace."""
        ...

    async def run(
        self,
        command: str,
        workspace: Path,
        uid: int,
        limits: Limits = ...,
        stdin: str | None = None,
    ) -> ExecResult: ...

    async def aclose(self) -> None: ...
