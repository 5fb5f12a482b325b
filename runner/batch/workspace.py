"""Filling a fresh workspace on the host, before the sandbox takes it over: from a local
directory or archive the task names (`workspace`), then the task's `files` on top.

This runs as root on files an untrusted dataset controls, so nothing here ever follows a
symlink: every path is created component by component through directory file descriptors
opened with O_NOFOLLOW; archive members with absolute paths, `..`, links leaving the
workspace, devices or fifos are refused; symlinks are created last, after every file (so
no later member can be written through one); the total size is bounded.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from ..tasks.formats import ARCHIVE_SUFFIXES, source_kind

MAX_ENTRIES = 200_000
_CHUNK = 1 << 20


class WorkspaceError(ValueError):
    """The workspace source is unusable or unsafe; the message says which entry and why."""


def _rel_parts(name: str, what: str) -> tuple[str, ...]:
    """The parts of a relative member path; WorkspaceError if it is absolute or uses '..'."""
    if "\x00" in name:
        raise WorkspaceError(f"{what} {name!r}: NUL in the name")
    p = PurePosixPath(name.replace("\\", "/") if what == "zip member" else name)
    if p.is_absolute():
        raise WorkspaceError(f"{what} {name!r}: absolute paths are not allowed")
    parts = tuple(x for x in p.parts if x not in ("", "."))
    if ".." in parts:
        raise WorkspaceError(f"{what} {name!r}: '..' is not allowed")
    return parts


def _check_link(parts: tuple[str, ...], target: str, what: str) -> None:
    """A symlink at `parts` pointing to `target` must stay inside the workspace (lexically,
    relative to the link's directory; absolute targets are refused)."""
    if not target or target.startswith("/") or "\x00" in target:
        raise WorkspaceError(f"{what} {'/'.join(parts)!r} -> {target!r}: link leaves the workspace")
    depth = len(parts) - 1  # directories above the link, inside the workspace
    for x in PurePosixPath(target).parts:
        if x == "..":
            depth -= 1
            if depth < 0:
                raise WorkspaceError(
                    f"{what} {'/'.join(parts)!r} -> {target!r}: link leaves the workspace"
                )
        elif x not in ("", "."):
            depth += 1


class _Writer:
    """Creates entries under `root` without following any symlink, and counts bytes."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit
        self.total = 0
        self.entries = 0
        self.links: list[tuple[tuple[str, ...], str]] = []

    def _count(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise WorkspaceError(f"more than {MAX_ENTRIES} entries")

    def _dirfd(self, parts: tuple[str, ...]) -> int:
        """An fd of root/parts (created as needed), never through a symlink."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for part in parts:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    raise WorkspaceError(
                        f"{'/'.join(parts)}: {part!r} is not a directory ({e.strerror})"
                    ) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, parts: tuple[str, ...]) -> None:
        self._count()
        if parts:
            os.close(self._dirfd(parts))

    def file(self, parts: tuple[str, ...], chunks: Iterable[bytes], mode: int = 0o644) -> None:
        """Write a regular file (replacing a regular file already there) from byte chunks."""
        if not parts:
            raise WorkspaceError("a file entry has an empty name")
        self._count()
        dfd = self._dirfd(parts[:-1])
        try:
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None:
                if not stat.S_ISREG(st.st_mode):
                    raise WorkspaceError(f"{'/'.join(parts)}: exists and is not a regular file")
                os.unlink(parts[-1], dir_fd=dfd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(parts[-1], flags, mode & 0o755 | 0o600, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    self.total += len(chunk)
                    if self.total > self.limit:
                        raise WorkspaceError(
                            f"the workspace would exceed its size limit of {self.limit} bytes"
                        )
                    f.write(chunk)
        finally:
            os.close(dfd)

    def symlink(self, parts: tuple[str, ...], target: str, what: str) -> None:
        _check_link(parts, target, what)
        self._count()
        self.links.append((parts, target))

    def finish(self) -> None:
        """Create the symlinks, last: nothing is written through them afterwards."""
        for parts, target in self.links:
            dfd = self._dirfd(parts[:-1])
            try:
                os.symlink(target, parts[-1], dir_fd=dfd)
            except FileExistsError:
                raise WorkspaceError(f"{'/'.join(parts)}: link name already exists") from None
            finally:
                os.close(dfd)


def _read_chunks(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def _copy_dir(src: Path, w: _Writer) -> None:
    for dirpath, dirnames, filenames, dirfd in os.fwalk(src, follow_symlinks=False):
        rel = Path(dirpath).relative_to(src).parts
        for name in sorted(dirnames + filenames):
            parts = (*rel, name)
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                w.mkdir(parts)
            elif stat.S_ISLNK(st.st_mode):
                w.symlink(parts, os.readlink(name, dir_fd=dirfd), "link")
            elif stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
                with os.fdopen(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        raise WorkspaceError(f"{'/'.join(parts)}: changed while being copied")
                    w.file(parts, _read_chunks(f), st.st_mode)
            else:
                raise WorkspaceError(
                    f"{'/'.join(parts)}: not a regular file, directory or symlink "
                    "(fifos, sockets and devices are not copied)"
                )


def _extract_tar(src: Path, w: _Writer) -> None:
    try:
        tf = tarfile.open(src, "r:*")  # noqa: SIM115 (closed by the with below)
    except (tarfile.TarError, OSError) as e:
        raise WorkspaceError(f"cannot read the archive: {e}") from None
    with tf:
        files: dict[tuple[str, ...], tarfile.TarInfo] = {}
        declared = 0
        for m in tf:  # lazily: a huge archive is refused at the first member over the limit
            parts = _rel_parts(m.name, "tar member")
            declared += m.size if m.isreg() else 0
            if declared > w.limit:
                raise WorkspaceError(
                    f"the archive holds more than {w.limit} bytes, the workspace size limit"
                )
            if m.isdir():
                w.mkdir(parts)
            elif m.isreg():
                f = tf.extractfile(m)
                assert f is not None
                with f:
                    w.file(parts, _read_chunks(f), m.mode)
                files[parts] = m
            elif m.issym():
                w.symlink(parts, m.linkname, "tar member")
            elif m.islnk():  # a hard link: a copy of a regular file extracted before it
                target = _rel_parts(m.linkname, "tar hard link target")
                if target not in files:
                    raise WorkspaceError(
                        f"tar member {m.name!r}: hard link to {m.linkname!r}, which is not a "
                        "regular file earlier in the archive"
                    )
                f = tf.extractfile(files[target])
                assert f is not None
                with f:
                    w.file(parts, _read_chunks(f), files[target].mode)
            else:
                raise WorkspaceError(
                    f"tar member {m.name!r}: devices, fifos and other special files are not allowed"
                )


def _extract_zip(src: Path, w: _Writer) -> None:
    try:
        zf = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, OSError) as e:
        raise WorkspaceError(f"cannot read the archive: {e}") from None
    with zf:
        infos = zf.infolist()
        declared = sum(i.file_size for i in infos)
        if declared > w.limit:
            raise WorkspaceError(
                f"the archive holds {declared} bytes, over the workspace limit of {w.limit}"
            )
        for info in infos:
            parts = _rel_parts(info.filename, "zip member")
            mode = info.external_attr >> 16
            if info.is_dir():
                w.mkdir(parts)
            elif stat.S_ISLNK(mode):
                target = zf.read(info).decode("utf-8", errors="replace")
                w.symlink(parts, target, "zip member")
            elif stat.S_IFMT(mode) in (0, stat.S_IFREG):  # no type bits: a plain file
                try:
                    with zf.open(info) as f:
                        w.file(parts, _read_chunks(f), stat.S_IMODE(mode) or 0o644)
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    raise WorkspaceError(f"zip member {info.filename!r}: {e}") from None
            else:
                raise WorkspaceError(f"zip member {info.filename!r}: special files not allowed")


def populate(ws: Path, source: Path | None, files: dict[str, str], limit: int) -> None:
    """Fill the (new, empty) directory `ws`: the source's content, then `files` on top.
    WorkspaceError (a ValueError) when the source is unusable or unsafe."""
    w = _Writer(ws, limit)
    if source is not None:
        kind = source_kind(source)
        try:
            if kind == "dir":
                _copy_dir(source, w)
            elif kind == "tar":
                _extract_tar(source, w)
            elif kind == "zip":
                _extract_zip(source, w)
            else:
                raise WorkspaceError(
                    f"{source}: not a directory or a {', '.join(ARCHIVE_SUFFIXES)} archive"
                )
        except WorkspaceError as e:
            raise WorkspaceError(f"workspace {source}: {e}") from None
        except OSError as e:
            raise WorkspaceError(f"workspace {source}: {e}") from None
    for rel, content in files.items():
        parts = _rel_parts(rel, "files path")
        w.file(parts, [content.encode("utf-8")])
    w.finish()
