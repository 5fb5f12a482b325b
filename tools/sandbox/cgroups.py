"""One cgroup v1 memory group per agent uid: bounds the agent's processes together, shared
mappings and tmpfs pages included, which rlimits cannot (RLIMIT_DATA ignores MAP_SHARED).
Groups live under /sys/fs/cgroup/memory/concur-<runner pid>/u<uid>; those of runner
processes that are gone are removed on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from pathlib import Path

from .limits import Limits
from .reaper import kill_cgroup, remove_cgroup

log = logging.getLogger("concur.sandbox")

_CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")  # the cgroup v1 memory controller


class _MemoryCgroups:
    """The groups of this process. The command places itself in its group before exec, so its
    whole tree is inside. Without a writable memory controller this is off, said once."""

    def __init__(self) -> None:
        self.root: Path | None = None
        try:
            if (_CGROUP_MEMORY / "memory.limit_in_bytes").exists() and os.access(
                _CGROUP_MEMORY, os.W_OK
            ):
                _remove_stale_cgroups()
                root = cgroup_folder()
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
    """Groups left by runner processes that are gone (killed before they could clean up):
    what still runs in them is killed first (a group with a process cannot be removed)."""
    for d in _CGROUP_MEMORY.glob("concur-*"):
        pid = d.name.removeprefix("concur-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if kill_cgroup(d):
                log.warning("killed processes left in %s by a dead run", d)
                time.sleep(0.05)  # SIGKILLed processes leave their group when reaped
            remove_cgroup(d)


def cgroup_folder() -> Path:
    """Where this process's memory groups go (made on first use, if the host has them)."""
    return _CGROUP_MEMORY / f"concur-{os.getpid()}"


_CGROUPS: _MemoryCgroups | None = None  # one per process, made on first use


def cgroup_prefix(uid: int, limits: Limits) -> list[str]:
    """argv that puts the command in its agent's memory cgroup, then execs the rest."""
    global _CGROUPS
    if _CGROUPS is None:
        _CGROUPS = _MemoryCgroups()
    procs = _CGROUPS.procs_file(uid, limits.memory_bytes)
    return [] if procs is None else ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs]


def close_cgroups() -> None:
    """Remove the agents' groups that are empty now (those still in use stay)."""
    if _CGROUPS is not None:
        _CGROUPS.close()
