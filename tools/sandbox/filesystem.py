"""Root code on the host that touches attacker-controlled workspace trees: one iterative
walker (`walk`) and what is built on it (chown, disk usage), plus removal and moving by GNU
tools that never follow symlinks. The sandbox can put anything in a workspace: symlinks to
host paths, FIFOs, hard links, trees deeper than Python's recursion limit.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .limits import check_uid
from .reaper import remove_folder
from .workspaces import release

log = logging.getLogger("concur.sandbox")

# Directories are opened without following links and without blocking: anything an agent
# swaps in for a directory (a symlink, a FIFO, a device) fails to open instead of steering or
# hanging a root thread.
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
WALK_MAX_ENTRIES = 200_000  # past this a workspace counts as over its size limit
WALK_MAX_DEPTH = 256
MIN_ENTRY_BYTES = 4096  # what disk_usage charges at least per file, directory or link


class WalkLimit(OSError):
    """A workspace too large (entries) or too deep to walk safely."""


def walk(root: Path) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry under root as (parent dir fd, name, lstat), depth first and iterative
    (no recursion limit to hit), at most WALK_MAX_DEPTH directories open at once."""
    fd = os.open(root, _OPEN_DIR)
    stack: list[tuple[int, Iterator[os.DirEntry[str]]]] = [(fd, os.scandir(fd))]
    n = 0
    try:
        while stack:
            fd, it = stack[-1]
            entry = next(it, None)
            if entry is None:
                stack.pop()
                _close_dir(fd, it)
                continue
            try:
                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            n += 1
            if n > WALK_MAX_ENTRIES:
                raise WalkLimit(f"{root}: more than {WALK_MAX_ENTRIES} entries")
            yield fd, entry.name, st
            if stat.S_ISDIR(st.st_mode):
                sub = _open_subdir(root, fd, entry.name, len(stack))
                if sub is not None:
                    stack.append((sub, os.scandir(sub)))
    finally:
        for fd, it in stack:
            _close_dir(fd, it)


def _open_subdir(root: Path, dirfd: int, name: str, depth: int) -> int | None:
    """An fd of the directory `name`, None if it is gone or no longer a directory."""
    if depth >= WALK_MAX_DEPTH:
        raise WalkLimit(f"{root}: nested deeper than {WALK_MAX_DEPTH} directories")
    try:
        return os.open(name, _OPEN_DIR, dir_fd=dirfd)
    except OSError:  # removed or swapped for a non-directory meanwhile
        return None


def _close_dir(fd: int, it: Iterator[os.DirEntry[str]]) -> None:
    # scandir(fd) returns a ScandirIterator (it has close()); typeshed types it as an Iterator.
    it.close()  # type: ignore[attr-defined]
    os.close(fd)


def chown_tree(root: Path, uid: int) -> None:
    # dir fds + follow_symlinks=False: symlinks planted in the workspace are never followed,
    # so this root-run chown cannot be steered at files outside it.
    os.chown(root, uid, uid, follow_symlinks=False)
    for dirfd, name, st in walk(root):
        if st.st_uid == uid and st.st_gid == uid:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            # A hard link may point at a file outside the workspace: leave it alone.
            log.warning("not chowning hard-linked file %s in %s", name, root)
            continue
        os.chown(name, uid, uid, dir_fd=dirfd, follow_symlinks=False)


def disk_usage(root: Path, limit: int) -> int:
    """Bytes allocated under root (du-like, symlinks not followed; every name, hard links
    included, costs at least one block, so masses of empty files or links count too). Stops
    early once past `limit`: the caller only needs to know whether it is over. A tree too big
    or too deep to walk counts as over (`limit + 1`)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    try:
        for _fd, _name, st in walk(root):
            blocks = st.st_blocks * 512
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    blocks = 0  # its data is counted once; the name still costs a block
                seen.add(key)
            total += max(blocks, MIN_ENTRY_BYTES)
            if total > limit:
                break
    except WalkLimit:
        return limit + 1
    except FileNotFoundError:
        pass
    return total


def check_traversable(workspace: Path, uid: int) -> None:
    """The uid (with no supplementary groups) must be able to reach the workspace: bwrap opens
    the bind source as that uid, and would otherwise fail with a cryptic message."""
    for parent in workspace.parents:
        st = parent.stat()
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == uid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise PermissionError(
                f"workspace {workspace} is not reachable by sandbox uid {uid}: {parent} "
                f"(mode {stat.filemode(st.st_mode)}) is not searchable by others. Put workspaces "
                f"under a directory with mode 0711 or 0755, or run `chmod o+x {parent}`."
            )


def prepare_tree(workspace: Path, uid: int) -> None:
    """mkdir -p, check the uid can reach it, chown -R uid:uid, mode 0700."""
    check_uid(uid)
    workspace = Path(workspace).resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    check_traversable(workspace, uid)
    chown_tree(workspace, uid)
    os.chmod(workspace, 0o700)


def remove_tree(path: Path) -> None:
    """Delete a workspace tree (as root, or in user mode as the user), safely: first unmount
    the workspace filesystems at or under it (workspaces.py), then GNU rm, which never
    follows symlinks, stays on one filesystem and has no recursion limit (shutil.rmtree in
    3.11 recurses: a deep tree made by an agent raises RecursionError), as the reaper does
    it. Missing paths are fine; failures are logged."""
    if not os.path.lexists(path):
        return
    try:
        release(path)
    except OSError as e:
        log.warning("could not unmount the workspace filesystem at %s: %s", path, e)
    problem = remove_folder(path)
    if problem:
        log.warning("could not remove %s: %s", path, problem[:500])


def move_tree(src: Path, dst: Path) -> None:
    """Move a workspace tree as root without letting it gain anything: a rename on the same
    filesystem; across filesystems (a workspace on its own filesystem included) `cp -a`
    (owners stay the agent's uid, never root; hard links, holes and symlinks kept as they
    are, never followed), then the source removed (unmounted). shutil.move would copy as
    root: setuid files would become root-owned, links expanded."""
    remove_tree(dst)
    if os.stat(src, follow_symlinks=False).st_dev == os.stat(dst.parent).st_dev:
        os.rename(src, dst)
        return
    r = subprocess.run(
        ["cp", "-a", "--one-file-system", "--", str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise OSError(f"could not copy {src} to {dst}: {r.stderr.strip()[:500]}")
    remove_tree(src)
