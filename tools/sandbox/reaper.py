"""The reaper: a small process beside each batch that cleans up after it if it is killed.

Parent-death signals alone do not tie every sandbox process to the runner: bwrap's sandbox
child sets its own only at the end of its setup, so a runner killed while a command starts
leaves that child orphaned, in its own namespaces, for good (and in the runner's cgroup, so
that stays too). So the batch starts this reaper (in its own session: a terminal's Ctrl-C
does not reach it) with the read end of a pipe only the runner writes to. When the runner
ends cleanly it says "done" first and the reaper just exits. When the runner dies, the read
gets EOF without "done": the reaper SIGKILLs every process of the run's leased uids (root),
of its cgroup, and those carrying its run mark with what shares their pid namespace (an
ordinary user's run: agents run as the user's own uid), until none is left, removes its
live-workspace folder and cgroup, and exits.
It inherits the run's uid-lease locks, so those uids are not leased again before it is
through.

Stdlib only, and run as a script (`python reaper.py ...`): it must not import the project.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

DONE = b"done"
# Every sandboxed command of a run carries MARK=<run mark> in its environment (outside bwrap
# and inside): how a non-root run finds its own leftovers among the user's other processes.
MARK = "CONCUR_RUN"
AGENT_MARK = "CONCUR_AGENT"  # mode "none" as a user: which agent a process belongs to


def process_uids() -> Iterable[tuple[int, int]]:
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


def kill_uid_processes(uids: Iterable[range]) -> int:
    """SIGKILL every live (not zombie) process whose real uid is in one of the ranges;
    -> how many."""
    ranges = list(uids)
    killed = 0
    for pid, uid in process_uids():
        if any(uid in r for r in ranges) and not _zombie(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def run_mark(pid: int | None = None) -> str:
    """The mark of a runner process: its pid and start time (a reused pid has another)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start_time(pid)}"


def mark_alive(mark: str) -> bool:
    """Is the runner that made `mark` still running?"""
    pid, _, start = mark.partition(".")
    return pid.isdigit() and _start_time(int(pid)) == start


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(v.partition(b"=")[::2] for v in f.read().split(b"\0") if v)
    except OSError:
        return {}


def _pid_ns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def marked_processes(want: Callable[[dict[bytes, bytes]], bool]) -> set[int]:
    """Processes of our own uid whose environment `want`s, and every process of our uid that
    shares a pid namespace (not ours) with one: a sandbox's pid 1 is marked, so whatever runs
    in its namespace goes with it even if it cleared its own environment."""
    me, own_ns = os.getuid(), _pid_ns(os.getpid())
    mine = [pid for pid, uid in process_uids() if uid == me and pid != os.getpid()]
    marked = {pid for pid in mine if want(_environ(pid))}
    spaces = {_pid_ns(pid) for pid in marked} - {own_ns, ""}
    if not spaces:  # all in our own namespace (mode none): no namespace to sweep
        return marked
    return marked | {pid for pid in mine if _pid_ns(pid) in spaces}


def kill_marked(want: Callable[[dict[bytes, bytes]], bool]) -> int:
    """SIGKILL what `marked_processes` finds (zombies aside); -> how many."""
    killed = 0
    for pid in marked_processes(want):
        if not _zombie(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def of_run(mark: str) -> Callable[[dict[bytes, bytes]], bool]:
    return lambda env: env.get(MARK.encode()) == mark.encode()


def of_dead_run(env: dict[bytes, bytes]) -> bool:
    mark = env.get(MARK.encode())
    return mark is not None and not mark_alive(mark.decode(errors="replace"))


def kill_cgroup(root: Path) -> int:
    """SIGKILL every process in the cgroup tree under `root` (cgroup v2: one write to
    cgroup.kill; also each listed pid, for v1 and for kernels without cgroup.kill)."""
    killed = 0
    with contextlib.suppress(OSError):
        (root / "cgroup.kill").write_text("1")
    for procs in root.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
    return killed


def remove_cgroup(root: Path, rmdir: Callable[[Path], None] = Path.rmdir) -> None:
    """Remove a cgroup and its children, deepest first (a busy one stays)."""
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            rmdir(d)
    with contextlib.suppress(OSError):
        rmdir(root)


# Workspaces on their own filesystems (tools/sandbox/workspaces.py) are unmounted before the
# folder is removed: rm --one-file-system would skip them, and the mounts would stay.
_MNT_DETACH = 2  # umount2 flags (linux/fs.h)
_UMOUNT_NOFOLLOW = 8
_libc = ctypes.CDLL(None, use_errno=True)


def mounts() -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, source) of every mount in this mount namespace."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, (fstype, source) = left.split(), right.split()[:2]
            found.append((_unescape(fields[4]), _unescape(fstype), _unescape(source)))
    return found


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040 ...)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def unmount(path: str) -> None:
    """Unmount the filesystem mounted at `path` (never following a symlink); if it is busy
    (a process still has a file open there), detach it: it goes once the last user does."""
    target = os.fsencode(path)
    if _libc.umount2(target, _UMOUNT_NOFOLLOW) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(target, _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
        return
    if err in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
        return
    raise OSError(err, f"cannot unmount {path}: {os.strerror(err)}")


def unmount_under(root: Path) -> int:
    """Unmount every filesystem mounted at `root` or below it, deepest first; -> how many.
    Only root can mount here (an agent's mounts live in its sandbox's own namespace)."""
    top = os.path.realpath(root)  # as mountinfo names it
    points = [mp for mp, _, _ in mounts() if mp == top or mp.startswith(top.rstrip("/") + "/")]
    for mp in sorted(points, key=lambda p: -p.count("/")):
        unmount(mp)
    return len(points)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def clean_up(
    uids: list[range], cgroup: Path | None, workspaces: Path | None, mark: str | None = None
) -> None:
    """Kill until nothing is left (a process may fork while the first pass runs), then
    remove the folders. Bounded: a process in uninterruptible sleep must not hang us."""
    for _ in range(50):
        n = kill_uid_processes(uids) if uids else 0
        n += kill_marked(of_run(mark)) if mark else 0
        n += kill_cgroup(cgroup) if cgroup is not None and cgroup.exists() else 0
        if n == 0:
            break
        time.sleep(0.05)
    if workspaces is not None:  # the workspaces' own filesystems first (not root: none)
        with contextlib.suppress(OSError):
            unmount_under(workspaces)

    if workspaces is not None and workspaces.exists():
        remove_folder(workspaces)
    if cgroup is not None and cgroup.exists():
        remove_cgroup(cgroup)


def remove_folder(path: Path) -> str:
    """rm -rf that never follows links nor leaves the filesystem; where it fails (not root:
    a directory an agent made unreadable, chmod 000) the tree is made ours again (chmod -R
    skips links) and removed once more. -> "" if removed, else rm's complaint."""
    argv = ["rm", "-rf", "--one-file-system", "--", str(path)]
    if subprocess.run(argv, capture_output=True, check=False).returncode == 0:
        return ""
    subprocess.run(["chmod", "-R", "u+rwx", "--", str(path)], capture_output=True, check=False)
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    return "" if r.returncode == 0 else r.stderr.strip() or f"rm exited {r.returncode}"


def main(argv: list[str]) -> int:
    """argv: PIPE_FD UID_RANGES CGROUP WORKSPACES MARK; UID_RANGES "first-end,..." (end
    excluded); '-': none."""
    fd, ranges, cgroup, workspaces, mark = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe decides
    got = b""
    while True:
        try:
            chunk = os.read(int(fd), 64)
        except InterruptedError:
            continue
        if not chunk:
            break
        got += chunk
    if got.endswith(DONE):
        return 0
    clean_up(
        [range(int(a), int(b)) for a, b in (r.split("-") for r in ranges.split(","))]
        if ranges != "-"
        else [],
        Path(cgroup) if cgroup != "-" else None,
        Path(workspaces) if workspaces != "-" else None,
        mark if mark != "-" else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


class Reaper:
    """The runner's side: start it with the run's uid ranges, cgroup, workspace folder, the
    lease's lock descriptors (inherited, so the uids stay leased until it is through) and the
    run mark its commands carry; `close()` at a clean end."""

    def __init__(
        self,
        uids: list[range],
        cgroup: Path | None,
        workspaces: Path | None,
        keep_fds: Iterable[int] = (),
        mark: str | None = None,
    ) -> None:
        r, self._w = os.pipe()  # both close-on-exec: only the reaper gets r, nobody gets w
        spec = ",".join(f"{u.start}-{u.stop}" for u in uids) or "-"
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    __file__,
                    str(r),
                    spec,
                    str(cgroup or "-"),
                    str(workspaces or "-"),
                    mark or "-",
                ],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(r, *keep_fds),
                start_new_session=True,
            )
        finally:
            os.close(r)

    def close(self) -> None:
        """The runner cleaned up itself: tell the reaper to do nothing."""
        if self._w < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._w, DONE)
        os.close(self._w)
        self._w = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
