"""Agent uids leased per run from a host-wide registry, so no two batches on one host share a
uid (RLIMIT_NPROC and the "kill every process of the uid" sweeps are per uid).

The registry is a root-owned directory (REGISTRY_DIR) holding one lock file per block of
BLOCK_SIZE uids; block k is the uids AGENT_UID_BASE + k*BLOCK_SIZE ... + BLOCK_SIZE - 1. A
run holds an flock on each block it uses for as long as it lives: the kernel drops the lock
when the process ends, however it ends, so a block of a killed run is free again at once.
A process of a block's uid that is still alive when the block is leased can only be a
leftover of a dead run (nobody else may use those uids): it is killed then.
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .cgroups import cgroup_folder
from .limits import AGENT_UID_BASE
from .reaper import Reaper, kill_marked, kill_uid_processes, of_dead_run, process_uids, run_mark

log = logging.getLogger("concur.sandbox")

REGISTRY_DIR = Path("/run/concur-runner/uids")
BLOCK_SIZE = 1024
MAX_BLOCKS = 2048  # uids up to AGENT_UID_BASE + 2**21: far below 2**31


class UidsExhausted(RuntimeError):
    """Every block is leased by a live run."""


@dataclass
class UidLease:
    """The uids of one run: agent i gets uid(i). `close()` (or the process's end) frees them."""

    blocks: list[int]
    _locks: list[IO[str]] = field(default_factory=list, repr=False)

    def uid(self, index: int) -> int:
        block, offset = divmod(index, BLOCK_SIZE)
        if not 0 <= block < len(self.blocks):
            raise IndexError(f"agent index {index} outside this lease of {self.capacity} uids")
        return AGENT_UID_BASE + self.blocks[block] * BLOCK_SIZE + offset

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK_SIZE

    def ranges(self) -> list[range]:
        return [block_range(b) for b in self.blocks]

    @property
    def locked(self) -> bool:
        """Whether the uids are really ours (root); an unlocked lease only labels agents."""
        return bool(self._locks)

    def lock_fds(self) -> list[int]:
        return [f.fileno() for f in self._locks]

    def close(self) -> None:
        for f in self._locks:
            f.close()  # closing the only descriptor drops the flock
        self._locks.clear()


def block_range(block: int) -> range:
    first = AGENT_UID_BASE + block * BLOCK_SIZE
    return range(first, first + BLOCK_SIZE)


def lease_uids(n_agents: int, registry: Path = REGISTRY_DIR) -> UidLease:
    """Lease enough blocks for `n_agents` agents (at least one block). Kills what dead runs
    left running under those uids. UidsExhausted if too few blocks are free. Not root: no
    process can be started as another uid, so there is nothing to lease (an unlocked lease;
    agents run as the user's own uid): what dead runs of this user left is killed instead."""
    want = max(1, -(-n_agents // BLOCK_SIZE))
    if os.geteuid() != 0:  # cannot switch uids at all: the numbers only label the agents
        killed = kill_marked(of_dead_run)
        if killed:
            log.warning("killed %d processes left running by a dead run of this user", killed)
        return UidLease(list(range(want)))
    _make_registry(registry)
    lease = UidLease([])
    try:
        for k in range(MAX_BLOCKS):
            if len(lease.blocks) == want:
                break
            lock = _try_lock(registry / f"block-{k}.lock")
            if lock is not None:
                lease.blocks.append(k)
                lease._locks.append(lock)
        if len(lease.blocks) < want:
            raise UidsExhausted(
                f"only {len(lease.blocks)} of the {want} uid blocks this run needs are free in "
                f"{registry} (other runs hold the rest); wait for them or run fewer agents"
            )
    except BaseException:
        lease.close()
        raise
    killed = kill_uid_processes(lease.ranges()) + _sweep_free_blocks(set(lease.blocks), registry)
    if killed:
        log.warning(
            "killed %d processes left running by a dead run under the uids leased now", killed
        )
    return lease


def _make_registry(registry: Path) -> None:
    """Root-owned, not writable by others: an agent uid must not be able to take a lock."""
    registry.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = registry.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(
            f"{registry} must be owned by uid {os.geteuid()} and not writable by group or "
            f"others (it is uid {st.st_uid}, mode {st.st_mode & 0o777:o})"
        )


def _try_lock(path: Path) -> IO[str] | None:
    f = path.open("a")  # close-on-exec: no child process inherits the lock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def start_reaper(lease: UidLease | None, workspaces: Path | None) -> Reaper:
    """The reaper of a run (tools/sandbox/reaper.py): if this process dies, it kills what
    runs under the lease's uids and in this process's cgroup and removes `workspaces`.
    Without a (locked) lease the uids are not ours to kill: the cgroup, the processes that
    carry this run's mark (not root: all of the user's own uid) and the folder."""
    if lease is None or not lease.locked:
        mark = run_mark() if os.geteuid() != 0 else None
        return Reaper([], cgroup_folder(), workspaces, mark=mark)
    return Reaper(lease.ranges(), cgroup_folder(), workspaces, lease.lock_fds())


def _sweep_free_blocks(mine: set[int], registry: Path) -> int:
    """Kill processes under uids of blocks no live run holds (left by a run whose reaper was
    killed too). -> how many."""
    span = range(AGENT_UID_BASE, AGENT_UID_BASE + MAX_BLOCKS * BLOCK_SIZE)
    found = {(uid - AGENT_UID_BASE) // BLOCK_SIZE for _, uid in process_uids() if uid in span}
    killed = 0
    for block in sorted(found - mine):
        lock = _try_lock(registry / f"block-{block}.lock")
        if lock is None:
            continue  # a live run's
        try:
            killed += kill_uid_processes([block_range(block)])
        finally:
            lock.close()
    return killed
