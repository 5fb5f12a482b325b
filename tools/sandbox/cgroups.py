"""One cgroup per agent: bounds the agent's processes together, shared mappings and tmpfs pages
included, which rlimits cannot (RLIMIT_DATA ignores MAP_SHARED), and where the host allows,
their number (pids) whatever uid they run as.

Which kind is found first on use, once per process:
- cgroup v2 only (the mount is cgroup2): memory.max and pids.max per agent, in root's own
  subtree or in one delegated to the user (cgroup2.py);
- a cgroup v1 memory controller (legacy or hybrid hosts), root: memory per agent under
  /sys/fs/cgroup/memory/concur-<runner pid>/u<uid>; those of runner processes that are gone
  are removed on first use. Only root can create v1 groups;
- otherwise none, said once, with why (`in_force()` tells the summary).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import cgroup2
from .limits import Limits
from .reaper import kill_cgroup, remove_cgroup

log = logging.getLogger("concur.sandbox")

CGROUP_MOUNT = Path("/sys/fs/cgroup")
_CGROUP_MEMORY = CGROUP_MOUNT / "memory"  # the cgroup v1 memory controller


@dataclass(frozen=True)
class CgroupState:
    """What the agents' cgroups bound here: `kind` "v1", "v2" or "none"; `where` the groups'
    parent (or why there are none)."""

    kind: str
    memory: bool
    pids: bool
    where: str


class _MemoryCgroups:
    """cgroup v1: the memory groups of this process. The command places itself in its group
    before exec, so its whole tree is inside."""

    def __init__(self, root: Path) -> None:
        _remove_stale_cgroups()
        root.mkdir(exist_ok=True)
        self.root = root

    def procs_file(self, uid: int, limits: Limits) -> str:
        d = self.root / f"u{uid}"
        if not d.exists():
            d.mkdir(parents=True)
            (d / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = d / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swap beyond the limit either
                swap.write_text(str(limits.memory_bytes))
        return str(d / "cgroup.procs")

    def close(self) -> None:
        for d in self.root.glob("u*"):
            with contextlib.suppress(OSError):  # a group still in use stays
                d.rmdir()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def _remove_stale_cgroups() -> None:
    """v1 groups left by runner processes that are gone (killed before they could clean up):
    what still runs in them is killed first (a group with a process cannot be removed)."""
    for d in _CGROUP_MEMORY.glob("concur-*"):
        pid = d.name.removeprefix("concur-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if kill_cgroup(d):
                log.warning("killed processes left in %s by a dead run", d)
                time.sleep(0.05)  # SIGKILLed processes leave their group when reaped
            remove_cgroup(d)


class _Cgroups:
    """This process's agent groups, of whichever kind the host has."""

    def __init__(self, mount: Path = CGROUP_MOUNT) -> None:
        self.v1: _MemoryCgroups | None = None
        self.v2: cgroup2.Cgroup2 | None = None
        self.state = self._find(mount)
        if self.state.kind == "none":
            log.warning(
                "no per-agent cgroup (%s): each agent's total memory (shared mappings "
                "included) is not bounded, only each process's data size",
                self.state.where,
            )
        else:
            atexit.register(self.close)

    def _find(self, mount: Path) -> CgroupState:
        if (mount / "cgroup.controllers").exists():  # the mount itself is cgroup2: v2 only
            return self._find_v2(mount)
        if not (_CGROUP_MEMORY / "memory.limit_in_bytes").exists():
            return CgroupState("none", False, False, f"no memory controller under {mount}")
        if not os.access(_CGROUP_MEMORY, os.W_OK):
            return CgroupState(
                "none",
                False,
                False,
                f"cgroup v1 at {_CGROUP_MEMORY}: only root can create groups there "
                f"(this is uid {os.geteuid()}), and v1 has no delegation to a user",
            )
        try:
            self.v1 = _MemoryCgroups(cgroup_v1_folder())
        except OSError as e:
            return CgroupState("none", False, False, f"cgroup v1 at {_CGROUP_MEMORY}: {e}")
        return CgroupState("v1", True, False, str(self.v1.root))

    def _find_v2(self, mount: Path) -> CgroupState:
        try:
            found = cgroup2.setup(mount, cgroup2.own_cgroup(), os.geteuid())
        except OSError as e:
            found = f"cgroup v2 at {mount}: {e}"
        if isinstance(found, str):
            return CgroupState("none", False, False, found)
        self.v2 = found
        c = found.controllers
        return CgroupState("v2", "memory" in c, "pids" in c, found.delegated)

    def folder(self) -> Path | None:
        if self.v2 is not None:
            return self.v2.run_dir
        return self.v1.root if self.v1 is not None else None

    def procs_file(self, uid: int, limits: Limits) -> str | None:
        group = self.v2 or self.v1
        return None if group is None else group.procs_file(uid, limits)

    def close(self) -> None:
        for group in (self.v1, self.v2):
            if group is not None:
                group.close()


def cgroup_v1_folder() -> Path:
    """Where this process's v1 memory groups go."""
    return _CGROUP_MEMORY / f"concur-{os.getpid()}"


_CGROUPS: _Cgroups | None = None  # one per process, made on first use


def _cgroups() -> _Cgroups:
    global _CGROUPS
    if _CGROUPS is None:
        _CGROUPS = _Cgroups()
    return _CGROUPS


def cgroup_folder() -> Path | None:
    """The folder of this process's agent groups (what its reaper kills); None without, or
    before a sandbox has looked for them (a simulated run has none)."""
    return None if _CGROUPS is None else _CGROUPS.folder()


def in_force() -> CgroupState:
    """What the agents' cgroups bound (found on first call)."""
    return _cgroups().state


def cgroup_prefix(uid: int, limits: Limits) -> list[str]:
    """argv that puts the command in its agent's cgroup, then execs the rest."""
    procs = _cgroups().procs_file(uid, limits)
    return [] if procs is None else join_argv(procs)


def join_argv(procs_file: str) -> list[str]:
    """argv that writes its own pid to `procs_file` (joining that group), then execs the rest:
    the command's whole tree is in the group from its first instruction."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs_file]


def close_cgroups() -> None:
    """Remove the agents' groups that are empty now (those still in use stay)."""
    if _CGROUPS is not None:
        _CGROUPS.close()
