"""Each workspace on its own size-limited filesystem, so that a write past the bound fails with
ENOSPC at the bound, whatever writes it (dd, fallocate, python, git): `make_workspace`.

Kinds (docs/sandbox.md has the trade-off and the measured costs):
- "tmpfs": a tmpfs mount of the limit's size. Exact and the cheapest to set up, but RAM-backed:
  a full workspace holds its limit in memory (charged to the agent's memory cgroup when the
  agent wrote it; swappable only where the host has swap).
- "ext4": a sparse ext4 image per workspace, loop-mounted. Disk-backed; costs mkfs, a loop
  device and tune2fs per workspace. The image file is unlinked once mounted, so unmounting
  frees everything (the loop device is auto-cleared).
- "watch": a plain directory; the sandbox measures the workspace while commands run and kills
  one past the limit (not exact: a fast writer overshoots; fallocate reserves gigabytes before
  any check). The fallback where nothing can be mounted (not root).

Every mount is named after the process that made it (pid and start time), so that what a
killed runner left is found and unmounted by the next one (`sweep_stale_mounts`); its reaper
unmounts its own (reaper.unmount_under), and `filesystem.remove_tree` unmounts before removing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .reaper import mark_alive, mounts, run_mark, unmount, unmount_under

log = logging.getLogger("concur.sandbox")

FS_KINDS = ("tmpfs", "ext4", "watch")
DEFAULT_FS = "tmpfs"
_BLOCK = 4096
_ENTRY_BYTES = 4096  # inodes allowed: one per 4 KiB of limit, like the watch's charge per entry
_MIN_INODES = 4096
_INODE_BYTES = 256  # ext4's inode size
_TAG = "concur-ws"  # tmpfs source "concur-ws.<pid>.<start>"; image ".concur-ws.<pid>.<start>.*"
_MS_NOSUID, _MS_NODEV = 2, 4
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class WorkspaceBound:
    """How one workspace's size is bounded: `fs` is "tmpfs" or "ext4" (exact: writes past
    `limit` bytes fail with ENOSPC) or "watch" (checked while commands run; `why` says why it
    is not exact when another kind was asked for)."""

    fs: str
    limit: int
    why: str = ""

    @property
    def exact(self) -> bool:
        return self.fs != "watch"


# The exact bounds this process mounted: path -> (bound, device of the mount).
_MOUNTED: dict[Path, tuple[WorkspaceBound, int]] = {}
_warned: set[str] = set()
_swept = False


def make_workspace(path: Path, limit: int, fs: str = DEFAULT_FS) -> WorkspaceBound:
    """Create `path` (which must not exist; parents are made) as an empty workspace whose size
    is bounded at `limit` bytes (rounded down to 4 KiB) on a filesystem of kind `fs`. Where
    that cannot be mounted (not root, no loop device, ...) it falls back to "watch", says why
    once in the log and in the returned bound. Remove it with `filesystem.remove_tree`."""
    if fs not in FS_KINDS:
        raise ValueError(f"unknown workspace filesystem {fs!r}; valid: {', '.join(FS_KINDS)}")
    path.mkdir(parents=True)
    path = Path(path).resolve()  # as the sandbox and /proc/self/mountinfo name it
    size = limit // _BLOCK * _BLOCK
    if fs == "watch":
        return WorkspaceBound("watch", limit)
    if os.geteuid() != 0:
        return _fallback(fs, limit, "not root: only root can mount a filesystem per workspace")
    if size == 0:
        return _fallback(fs, limit, f"a limit of {limit} bytes is below one 4 KiB block")
    _sweep_once()
    try:
        if fs == "tmpfs":
            _mount_tmpfs(path, size)
        else:
            _mount_image(path, size)
    except OSError as e:
        with contextlib.suppress(OSError):
            unmount_under(path)
        return _fallback(fs, limit, str(e))
    bound = WorkspaceBound(fs, size)
    _MOUNTED[path] = (bound, os.stat(path).st_dev)
    return bound


def probe_workspace(limit: int, fs: str = DEFAULT_FS) -> WorkspaceBound:
    """Make one workspace of kind `fs` in the temporary folder and remove it: the bound the
    run's workspaces will get here, known before any agent starts (for the start-up log)."""
    if fs == "watch":
        return WorkspaceBound("watch", limit)
    try:
        top = Path(tempfile.mkdtemp(prefix="concur-ws-probe-"))
    except OSError as e:  # a full or missing temporary folder: say so, do not stop here
        return WorkspaceBound("watch", limit, f"no probe workspace in {tempfile.gettempdir()}: {e}")
    try:
        return make_workspace(top / "probe", limit, fs)
    finally:
        release(top)
        shutil.rmtree(top, ignore_errors=True)


def workspace_bound(path: Path) -> WorkspaceBound | None:
    """The exact bound of a workspace this process made and that is still mounted, else
    None (then only the watch bounds it)."""
    entry = _MOUNTED.get(Path(path).resolve())
    if entry is None:
        return None
    try:
        return entry[0] if os.stat(path).st_dev == entry[1] else None
    except OSError:
        return None


def space(path: Path, bound: WorkspaceBound) -> tuple[int, int]:
    """(bytes used, bytes an agent can still write) of an exactly bounded workspace, from its
    filesystem (statvfs: what an unprivileged writer may still allocate)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    return max(0, bound.limit - free), free


def release(path: Path) -> None:
    """Unmount whatever is mounted at or under `path` (deepest first) and forget it."""
    top = Path(path).resolve()
    for p in [p for p in _MOUNTED if p == top or top in p.parents]:
        del _MOUNTED[p]
    unmount_under(top)


def sweep_stale_mounts() -> int:
    """Unmount the workspace filesystems of runner processes that are gone (a runner and its
    reaper both killed) and remove their now empty mount points; -> how many."""
    n = 0
    for mp, fstype, source in mounts():
        owner = _owner(fstype, source)
        if owner is None or mark_alive(owner):
            continue
        try:
            unmount(mp)
        except OSError as e:
            log.warning("could not unmount a dead runner's workspace %s: %s", mp, e)
            continue
        with contextlib.suppress(OSError):
            os.rmdir(mp)
        n += 1
    n += _detach_stale_loops()
    if n:
        log.warning("unmounted %d workspace filesystems left by dead runners", n)
    return n


def _sweep_once() -> None:
    global _swept
    if not _swept:
        _swept = True
        sweep_stale_mounts()


def _fallback(fs: str, limit: int, why: str) -> WorkspaceBound:
    msg = (
        f"workspaces not on their own {fs} filesystem ({why}): the workspace size is only "
        f"checked while commands run, so a fast writer can overshoot its limit"
    )
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)
    return WorkspaceBound("watch", limit, why)


def _owner_tag() -> str:
    return f"{_TAG}.{run_mark()}"


def _mount_tmpfs(path: Path, size: int) -> None:
    inodes = max(_MIN_INODES, size // _ENTRY_BYTES)
    opts = f"size={size},nr_inodes={inodes},mode=0700,uid=0,gid=0"
    # Huge pages for the parts of files they fill whole (measured: ~10x the throughput of 4 KiB
    # pages here); small files keep small pages, and so does the last bit before the limit.
    # Kernels without transparent huge pages refuse the option: then without it.
    for extra in (",huge=within_size", ""):
        err = _mount(_owner_tag(), path, "tmpfs", opts + extra)
        if err == 0:
            return
        if err != errno.EINVAL:
            break
    raise OSError(err, f"mount -t tmpfs on {path}: {os.strerror(err)}")


def _mount(source: str, target: Path, fstype: str, opts: str) -> int:
    """mount(2), nosuid and nodev; -> 0 or the errno."""
    flags = _MS_NOSUID | _MS_NODEV
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, opts.encode()):
        return ctypes.get_errno()
    return 0


def _mount_image(path: Path, size: int) -> None:
    """A sparse ext4 image, its free space for unprivileged writers exactly `size` (the rest
    reserved for root by tune2fs -r), loop-mounted at `path`; the file unlinked once mounted."""
    fd, img = tempfile.mkstemp(prefix=f".{_owner_tag()}.", suffix=".img", dir=path.parent)
    try:
        inodes = max(_MIN_INODES, size // _ENTRY_BYTES)
        # room for ext4's own: inode tables, bitmaps, descriptors, its 2% reserve (at most 16 MiB)
        os.ftruncate(fd, size + inodes * _INODE_BYTES + size // 32 + 2**20)
        os.close(fd)
        # no journal: a workspace does not outlive a crash; nodiscard: the file stays sparse
        mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-b", str(_BLOCK), "-I", str(_INODE_BYTES)]
        mkfs += ["-N", str(inodes)]
        _cmd(*mkfs, "-O", "^has_journal,^resize_inode", "-E", "nodiscard,lazy_itable_init=1", img)
        _cmd("mount", "-o", "loop,nosuid,nodev,noinit_itable", img, str(path))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(img)  # the loop device keeps it; unmounting frees it
    os.rmdir(path / "lost+found")  # not the agent's (and a git add would trip over it)
    # The whole tree, its root directory's own block included, must fit in `size`.
    room = size - os.stat(path).st_blocks * 512
    st = os.statvfs(path)
    reserve = st.f_bavail - room // st.f_frsize
    if reserve < 0:
        raise OSError(f"ext4 image for {path}: {st.f_bavail} free blocks, fewer than the limit")
    _cmd("tune2fs", "-r", str(reserve), _source(path))
    if os.statvfs(path).f_bavail * st.f_frsize != room:
        raise OSError(f"ext4 image for {path}: free space is not the limit after tune2fs")


def _cmd(*argv: str) -> None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise OSError(f"{argv[0]} is not installed (apt-get install -y e2fsprogs)") from None
    if r.returncode != 0:
        raise OSError(f"{argv[0]} failed: {(r.stderr or r.stdout).strip()[:300]}")


def _source(path: Path) -> str:
    top = str(path)
    for mp, _fstype, source in reversed(mounts()):
        if mp == top:
            return source
    raise OSError(f"{path} is not mounted")


def _detach_stale_loops() -> int:
    """Detach the loop devices of dead runners' images that never got mounted (a runner
    killed inside `mount -o loop`: auto-clear only acts on an unmount); -> how many."""
    mounted = {source for _, _, source in mounts()}
    n = 0
    for block in Path("/sys/block").glob("loop*"):
        dev = f"/dev/{block.name}"
        owner = _tag_owner(_backing_name(dev))
        if owner is None or mark_alive(owner) or dev in mounted:
            continue
        try:
            _cmd("losetup", "-d", dev)
            n += 1
        except OSError as e:
            log.warning("could not detach a dead runner's loop device %s: %s", dev, e)
    return n


def _owner(fstype: str, source: str) -> str | None:
    """The run mark (pid.start time) of the runner that mounted a workspace filesystem, None
    if not ours."""
    if fstype == "tmpfs":
        return _tag_owner(source)
    if fstype == "ext4" and source.startswith("/dev/loop"):
        return _tag_owner(_backing_name(source))
    return None


def _tag_owner(tag: str) -> str | None:
    """The run mark (reaper.run_mark) in one of our tags, None if it is not one."""
    if not tag.startswith(_TAG + "."):
        return None
    parts = tag.split(".")
    if len(parts) < 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return f"{parts[1]}.{parts[2]}"


def _backing_name(loop: str) -> str:
    """The file name behind a loop device, without a leading dot ("" if unknown)."""
    try:
        backing = Path(f"/sys/block/{Path(loop).name}/loop/backing_file").read_text()
    except OSError:
        return ""
    return Path(backing.strip().removesuffix(" (deleted)")).name.lstrip(".")
