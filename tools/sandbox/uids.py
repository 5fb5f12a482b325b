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

import contextlib
import fcntl
import logging
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .limits import AGENT_UID_BASE

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

    def uids(self) -> Iterable[int]:
        for b in self.blocks:
            yield from range(AGENT_UID_BASE + b * BLOCK_SIZE, AGENT_UID_BASE + (b + 1) * BLOCK_SIZE)

    def close(self) -> None:
        for f in self._locks:
            f.close()  # closing the only descriptor drops the flock
        self._locks.clear()


def lease_uids(n_agents: int, registry: Path = REGISTRY_DIR) -> UidLease:
    """Lease enough blocks for `n_agents` agents (at least one block). Kills what dead runs
    left running under those uids. UidsExhausted if too few blocks are free. Not root: no
    process can be started as another uid, so there is nothing to lease (an unlocked lease)."""
    want = max(1, -(-n_agents // BLOCK_SIZE))
    if os.geteuid() != 0:  # cannot switch uids at all: the numbers only label the agents
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
    killed = kill_uid_processes(set(lease.uids()))
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


def kill_uid_processes(uids: set[int]) -> int:
    """SIGKILL every process whose real uid is in `uids`; -> how many were signalled."""
    killed = 0
    for pid, uid in _process_uids():
        if uid in uids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def _process_uids() -> Iterable[tuple[int, int]]:
    """(pid, real uid) of every process, from /proc (a process may end while we read)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        yield int(entry.name), int(line.split()[1])
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
