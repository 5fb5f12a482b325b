"""Which limits a sandbox really enforces on this host (for summary.json and the log): the
mode, and for memory and processes what bounds them and per what (agent, command, process or
the whole batch), as found at start-up (cgroups, kernel, privileges)."""

from __future__ import annotations

import os
import resource
from typing import Any

from .cgroups import CgroupState, in_force
from .limits import CommandSandbox, Limits
from .sandboxes import BwrapSandbox, Sandbox
from .workspaces import probe_workspace

BWRAP_FILESYSTEM = (
    "own mount namespace: read-only /usr and a few /etc files, the workspace at /work, "
    "private /tmp and /dev/shm; nothing else of the host (no /home, /root, /run, host /tmp)"
)


def limits_in_force(
    sandbox: CommandSandbox, limits: Limits, workspace_fs: str = "watch"
) -> dict[str, Any]:
    """What bounds the agents' commands here, the workspaces made on `workspace_fs`
    (workspaces.py). A sandbox that runs no commands (the simulator's) only has its mode."""
    if not isinstance(sandbox, Sandbox):
        return {"sandbox": sandbox.mode}
    cg = in_force()
    bwrap = isinstance(sandbox, BwrapSandbox)
    return {
        "sandbox": sandbox.privilege if bwrap else "none",
        "privilege": sandbox.privilege,
        "uid": (
            f"the user's own ({os.geteuid()}), mapped inside each command's user namespace"
            if sandbox.user and bwrap
            else f"the user's own ({os.geteuid()})"
            if sandbox.user
            else "one unprivileged host uid per agent, leased per run"
        ),
        "filesystem": BWRAP_FILESYSTEM if bwrap else "host (no isolation)",
        "network": "none (own network namespace: loopback only)" if bwrap else "host",
        "memory": _memory(cg, limits),
        "processes": _processes(sandbox, cg, limits),
        "workspace": _workspace(limits, workspace_fs),
        "per_process": {
            "data_bytes": limits.data_bytes,
            "cpu_seconds": limits.cpu_s,
            "file_bytes": limits.fsize_bytes,
            "open_files": limits.nofile,
        },
        "tmp_bytes": limits.tmp_bytes if bwrap else None,
        "cgroup": {"kind": cg.kind, "where": cg.where},
    }


def _memory(cg: CgroupState, limits: Limits) -> dict[str, Any]:
    if cg.memory:
        by = "cgroup v2 memory.max" if cg.kind == "v2" else "cgroup v1 memory.limit_in_bytes"
        return {"per": "agent", "max_bytes": limits.memory_bytes, "by": by}
    return {
        "per": "process",
        "max_bytes": limits.data_bytes,
        "by": f"RLIMIT_DATA only (shared mappings not covered): {cg.where}",
    }


def _processes(sandbox: Sandbox, cg: CgroupState, limits: Limits) -> dict[str, Any]:
    if cg.pids:
        return {"per": "agent", "max": limits.nproc, "by": "cgroup v2 pids.max"}
    if not sandbox.user:
        return {"per": "agent", "max": limits.nproc, "by": "RLIMIT_NPROC of the agent's uid"}
    if isinstance(sandbox, BwrapSandbox) and sandbox.nproc_inside:
        return {
            "per": "command",
            "max": limits.nproc,
            "by": "RLIMIT_NPROC inside the command's own user namespace (an agent runs one "
            "command at a time)",
        }
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    return {
        "per": "batch",
        "max": None if soft == resource.RLIM_INFINITY else soft,
        "by": f"RLIMIT_NPROC of uid {os.geteuid()}: all of its processes together",
    }


def _workspace(limits: Limits, fs: str) -> dict[str, Any]:
    """Exact where each workspace is its own filesystem, which needs root to mount."""
    exact = fs != "watch" and os.geteuid() == 0
    return {
        "max_bytes": limits.workspace_bytes,
        "bound": "exact" if exact else "watched",
        "fs": fs if exact else "watch",
    }


def limits_line(sandbox: CommandSandbox, limits: Limits, workspace_fs: str = "watch") -> str:
    """The same in one log line, before any agent starts: the workspace bound is that of a
    probe workspace made and removed now, so "exact" means one could be mounted."""
    d = limits_in_force(sandbox, limits, workspace_fs)
    if "memory" not in d:
        return f"sandbox {d['sandbox']}"
    mem, procs = d["memory"], d["processes"]
    probe = probe_workspace(limits.workspace_bytes, workspace_fs)
    bound = f"exact ({probe.fs})" if probe.exact else f"watched ({probe.why or 'asked for'})"
    return (
        f"sandbox {d['sandbox']} mode ({sandbox.mode}): network {d['network'].split(' ')[0]}; "
        f"memory {mem['max_bytes'] // 2**20} MiB per {mem['per']} ({mem['by'].split(':')[0]}); "
        "processes "
        f"{procs['max']} per {procs['per']} ({procs['by']}); workspace "
        f"{limits.workspace_bytes // 2**20} MiB, {bound}"
    )
