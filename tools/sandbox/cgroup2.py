"""Per-agent cgroup v2 groups (memory.max, memory.swap.max, pids.max) where only cgroup v2 is
mounted. Where the groups go:

- root: its own subtree `<mount>/concur-runner/`, with the controllers enabled in the mount
  root's and its own `cgroup.subtree_control`;
- an ordinary user: only a subtree delegated to it (owned by its uid, e.g. a systemd unit
  with `Delegate=yes`: `systemd-run --user --scope -p Delegate=yes ...`) that this process
  runs in. A process may only move others between groups below a group it can write, so a
  delegated tree the runner is not in (e.g. user@UID.service, seen from a login session's
  scope) is of no use; it is named in the reason instead. v2's "no internal processes" rule:
  the runner first moves what runs in its group into a leaf `runner/`, then enables the
  controllers there.

Layout: `<base>/concur-<runner pid>.<its start time>/u<uid>`; groups of runners that are gone
are killed (cgroup.kill) and removed on first use. The kernel's side of the files (mkdir makes
a group's interface files, rmdir removes them) goes through `CgroupFS`, so that a test can run
all of this against a double of the cgroup2 file layout.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .limits import Limits
from .reaper import kill_cgroup, mark_alive, remove_cgroup, run_mark

CONTROLLERS = ("memory", "pids")
ROOT_SUBTREE = "concur-runner"  # root's own subtree under the mount
LEAF = "runner"  # where the runner's own processes go in a delegated subtree


class CgroupFS(Protocol):
    """What the kernel does on mkdir/rmdir in a cgroup2 mount."""

    def mkdir(self, path: Path) -> None: ...

    def rmdir(self, path: Path) -> None: ...


class KernelFS:
    def mkdir(self, path: Path) -> None:
        path.mkdir(exist_ok=True)

    def rmdir(self, path: Path) -> None:
        path.rmdir()


def own_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str:
    """This process's cgroup v2 path ("/user.slice/..."), from its "0::" line."""
    for line in Path(proc_cgroup).read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise OSError(f"no cgroup v2 line in {proc_cgroup}")


@dataclass
class Cgroup2:
    """The per-agent groups of this process under `base` (a subtree we may create groups in),
    with `controllers` enabled."""

    base: Path
    controllers: tuple[str, ...]
    fs: CgroupFS
    delegated: str  # how base came to be ours, for the summary and the log

    @property
    def run_dir(self) -> Path:
        return self.base / f"concur-{run_mark()}"  # pid and start time: never a reused pid's

    def start(self) -> None:
        """Kill and remove dead runners' groups, make this runner's."""
        for d in self.base.glob("concur-*"):
            if not mark_alive(d.name.removeprefix("concur-")):
                remove_group(d, self.fs, kill=True)
        self.fs.mkdir(self.run_dir)
        enable(self.run_dir, self.controllers)

    def procs_file(self, uid: int, limits: Limits) -> str:
        d = self.run_dir / f"u{uid}"
        if not d.exists():
            self.fs.mkdir(d)
            if "memory" in self.controllers:
                (d / "memory.max").write_text(str(limits.memory_bytes))
                swap = d / "memory.swap.max"
                if swap.exists():  # absent without swap accounting
                    swap.write_text("0")  # no swap beyond the limit either
            if "pids" in self.controllers:
                (d / "pids.max").write_text(str(limits.nproc))
        return str(d / "cgroup.procs")

    def close(self) -> None:
        """Remove the groups that are empty (a group still in use stays)."""
        with contextlib.suppress(OSError):
            remove_group(self.run_dir, self.fs, kill=False)


def enable(group: Path, controllers: tuple[str, ...]) -> None:
    """Enable the controllers for the group's children (one write: "+memory +pids")."""
    (group / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in controllers))


def remove_group(group: Path, fs: CgroupFS, kill: bool) -> None:
    """Remove `group` and its children, deepest first; with `kill`, SIGKILL what runs in it
    first and give the kernel a moment to empty it (cgroup.events: populated 0)."""
    if kill:
        kill_cgroup(group)
        deadline = time.monotonic() + 1.0
        while _populated(group) and time.monotonic() < deadline:
            time.sleep(0.01)
    remove_cgroup(group, fs.rmdir)


def _populated(group: Path) -> bool:
    try:
        return "populated 1" in (group / "cgroup.events").read_text()
    except OSError:
        return False


def setup(mount: Path, own: str, euid: int, fs: CgroupFS | None = None) -> Cgroup2 | str:
    """This process's groups under `mount` (a cgroup2 mount), or why there are none."""
    fs = fs or KernelFS()
    try:
        found = _root_base(mount, fs) if euid == 0 else _delegated_base(mount, own, euid, fs)
        if isinstance(found, str):
            return found
        base, controllers, delegated = found
        cg = Cgroup2(base, controllers, fs, delegated)
        cg.start()
        return cg
    except OSError as e:
        return f"cgroup v2 at {mount}: {e}"


def _available(group: Path) -> tuple[str, ...]:
    have = (group / "cgroup.controllers").read_text().split()
    return tuple(c for c in CONTROLLERS if c in have)


def _root_base(mount: Path, fs: CgroupFS) -> tuple[Path, tuple[str, ...], str] | str:
    wanted = _available(mount)
    if not wanted:
        return f"cgroup v2 at {mount} offers neither the memory nor the pids controller"
    try:  # the root group may have processes and controllers both; a container's may not
        enable(mount, wanted)
    except OSError as e:
        return (
            f"cannot enable {' and '.join(wanted)} in {mount}/cgroup.subtree_control ({e}): "
            "in a container the cgroup root is not the host's; give it a delegated subtree"
        )
    base = mount / ROOT_SUBTREE
    fs.mkdir(base)
    enable(base, wanted)
    return base, wanted, f"root: {base}"


def _delegated_base(
    mount: Path, own: str, euid: int, fs: CgroupFS
) -> tuple[Path, tuple[str, ...], str] | str:
    here = mount / own.lstrip("/")
    base = here.parent if here.name == LEAF else here  # a runner before us prepared it
    if not _writable_by(base, euid):
        return (
            f"no cgroup v2 subtree is delegated to uid {euid}: this process's cgroup {own} is "
            f"not writable by it{_hint(mount, euid)}"
        )
    wanted = _available(base)
    if not wanted:
        return f"the delegated cgroup {base} offers neither the memory nor the pids controller"
    if here.name != LEAF:  # "no internal processes": move ours into a leaf first
        leaf = base / LEAF
        fs.mkdir(leaf)
        for pid in (base / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                (leaf / "cgroup.procs").write_text(pid)
    enable(base, wanted)
    return base, wanted, f"delegated to uid {euid}: {base}"


def _writable_by(group: Path, euid: int) -> bool:
    files = (group, group / "cgroup.procs", group / "cgroup.subtree_control")
    return all(p.exists() and p.stat().st_uid == euid and os.access(p, os.W_OK) for p in files)


def _hint(mount: Path, euid: int) -> str:
    unit = mount / "user.slice" / f"user-{euid}.slice" / f"user@{euid}.service"
    where = (
        f" ({unit} is, but this process does not run inside it)" if _writable_by(unit, euid) else ""
    )
    return (
        f"{where}. For per-agent memory and process limits start the runner in a delegated "
        "unit: systemd-run --user --scope -p Delegate=yes python run.py ..."
    )
