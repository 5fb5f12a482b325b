"""The command line a sandboxed command runs under: the wrappers every mode puts in front of
it (the agent's cgroup, `prlimit`, `setpriv`), bubblewrap's flags and the environment inside,
and the startup probe that runs one real command with them.

bwrap is never started as root (a root-started bwrap could remount / read-write): root mode
starts it *as the agent's uid* (setpriv), user mode (an ordinary user) as the user itself, in
an unprivileged user namespace as Flatpak does. All namespaces unshared, a read-only view of
/usr and a few /etc files, the workspace bound read-write at /work, private size-limited
tmpfs mounts for /tmp and /dev/shm. RLIMIT_NPROC counts per (user namespace, uid) since Linux
5.14, so in user mode it is set inside the sandbox (an inner `prlimit`), where it bounds that
sandbox alone; set outside, it would count every sandbox of the user together.
No `preexec_fn`/`user=`: plain fork+exec of small wrappers.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .cgroups import cgroup_prefix
from .filesystem import prepare_tree
from .limits import PROBE_UID, Limits, SandboxUnavailable
from .reaper import MARK

BASH = "/usr/bin/bash"
INNER_PATH = "/usr/local/bin:/usr/bin:/bin"
INNER_PRLIMIT = "/usr/bin/prlimit"  # user mode: sets RLIMIT_NPROC inside (/usr is bound)
# Where the wrappers are looked up: a fixed list, so the caller's PATH cannot pick them.
_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# /etc entries the tools inside need; everything else in /etc (shadow, ssh keys, ...) stays out.
_ETC_FILES = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/ld.so.cache",
    "/etc/alternatives",  # /usr/bin/python3-ish alternatives symlinks point through here
    "/etc/ssl",
    "/etc/localtime",
    "/etc/hosts",  # so "localhost" resolves for servers a test starts inside the sandbox
)
_ETC_GLOBS = ("/etc/python3*",)  # sysconfig / site data of Debian's python3.x
# Top-level usr-merge symlinks (or real dirs on non-merged systems).
_ROOT_LIBDIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PROBE_TIMEOUT_S = 15.0

_NAMESPACE_FLAGS = (
    "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces: only `lo`, own pids
    "--unshare-user",
    "--disable-userns",  # no nested user namespaces (no way to regain capabilities)
    "--die-with-parent",
    "--new-session",  # setsid: no TIOCSTI into a controlling terminal
    # The command is the namespace's pid 1, a direct child of bwrap, which reaps it. With
    # bwrap's own init as pid 1, bwrap exits without reaping that init, and it lingers as a
    # zombie of the host's init (seconds here), still counting against RLIMIT_NPROC.
    "--as-pid-1",
    "--cap-drop",
    "ALL",
    "--hostname",
    "sandbox",
)


def which(name: str) -> str | None:
    return shutil.which(name, path=_TOOL_PATH)


def host_wrappers(user: bool = False) -> tuple[str, str]:
    """(prlimit, setpriv): the wrappers every mode needs; root mode needs root as well."""
    if not user and os.geteuid() != 0:
        raise SandboxUnavailable(
            "--sandbox bwrap-root must be started as root: it drops every command to a "
            "per-agent uid with setpriv (CAP_SETUID needed). As an ordinary user, "
            "--sandbox bwrap (the default) runs each command in an unprivileged user namespace"
        )
    prlimit, setpriv = which("prlimit"), which("setpriv")
    missing = [n for n, p in (("prlimit", prlimit), ("setpriv", setpriv)) if p is None]
    if prlimit is None or setpriv is None or not os.access(BASH, os.X_OK):
        raise SandboxUnavailable(
            f"missing {', '.join(missing) or BASH}: install util-linux and bash "
            "(apt-get install -y util-linux bash)."
        )
    return prlimit, setpriv


def find_bwrap() -> str:
    bwrap = which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(unavailable_message("bwrap is not installed"))
    return bwrap


def prlimit_argv(prlimit: str, limits: Limits, nproc: bool = True) -> list[str]:
    # soft == hard, so the sandboxed code cannot raise them back. Not `nproc` where the uid
    # is the user's own: RLIMIT_NPROC would count all of the user's processes together.
    return [
        prlimit,
        f"--data={limits.data_bytes}",
        f"--cpu={limits.cpu_s}",
        *([f"--nproc={limits.nproc}"] if nproc else []),
        f"--fsize={limits.fsize_bytes}",
        f"--nofile={limits.nofile}",
        "--core=0",  # no core dumps landing in the workspace
        "--",
    ]


def setpriv_argv(setpriv: str, uid: int | None) -> list[str]:
    # pdeathsig: if this Python process dies, the wrapped command (bwrap) is killed too.
    # uid None: stay the user we are (user mode; no uid switch is possible).
    switch = [] if uid is None else [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [setpriv, *switch, "--pdeathsig=KILL", "--"]


def inner_env(home: str, mark: str | None = None) -> dict[str, str]:
    return {
        "PATH": INNER_PATH,
        "HOME": home,  # git and friends want a writable HOME; the workspace is the only one
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TMPDIR": "/tmp",
        **({MARK: mark} if mark else {}),  # how the reaper finds a dead run's leftovers
    }


@dataclass(frozen=True)
class Wrapping:
    """How commands are wrapped: `user` mode (bwrap as the user itself; no uid switch, no
    chown), RLIMIT_NPROC set inside each sandbox (`nproc_inside`), the run `mark`."""

    user: bool = False
    nproc_inside: bool = False
    mark: str | None = None


def bwrap_argv(
    wrappers: tuple[str, str],
    bwrap: str,
    command: str,
    workspace: Path,
    uid: int,
    limits: Limits,
    info_fd: int | None,
    workdir: str = "/work",
    how: Wrapping = Wrapping(),
    inner_nproc: int | None = None,
) -> list[str]:
    """The whole command line of one sandboxed `bash -c command`. It starts in "/"; the
    command's cwd comes from --chdir. `inner_nproc`: the probe's RLIMIT_NPROC inside, instead
    of the limits' (which also size the agent's pids cgroup)."""
    prlimit, setpriv = wrappers
    argv = [
        *cgroup_prefix(uid, limits),
        *prlimit_argv(prlimit, limits, nproc=not how.user),
        *setpriv_argv(setpriv, None if how.user else uid),
        bwrap,
        *bwrap_flags(workspace, limits, workdir, inner_env(workdir, how.mark)),
    ]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    nproc = inner_nproc or limits.nproc
    inner = [INNER_PRLIMIT, f"--nproc={nproc}", "--"] if how.nproc_inside else []
    return [*argv, "--", *inner, BASH, "-c", command]


def bwrap_flags(workspace: Path, limits: Limits, workdir: str, env: dict[str, str]) -> list[str]:
    # Order matters: mounts apply in order, and / is remounted read-only after all of them.
    return [
        *_NAMESPACE_FLAGS,
        *_system_binds(),
        *_dev_and_tmp(limits),
        *("--bind", str(workspace), workdir, "--chdir", workdir),
        *("--remount-ro", "/", "--clearenv"),
        *(flag for k, v in env.items() for flag in ("--setenv", k, v)),
    ]


def _system_binds() -> list[str]:
    """Read-only /usr, the usr-merge links (or dirs) beside it, and the few /etc files."""
    flags = ["--ro-bind", "/usr", "/usr"]
    for d in _ROOT_LIBDIRS:
        if os.path.islink(d):
            flags += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            flags += ["--ro-bind", d, d]
    etc = list(_ETC_FILES) + sorted(p for g in _ETC_GLOBS for p in glob.glob(g))
    for p in etc:
        flags += ["--ro-bind-try", p, p]
    return flags


def _dev_and_tmp(limits: Limits) -> list[str]:
    size = str(limits.tmp_bytes)
    return [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        # bwrap's /dev is an unbounded tmpfs: bound /dev/shm, make the rest read-only.
        *("--size", size, "--tmpfs", "/dev/shm"),
        # No pseudo-terminals: every sandbox's devpts shares one kernel-wide pool (pty.max),
        # which one agent could exhaust for all others.
        *("--ro-bind", "/dev/null", "/dev/pts/ptmx"),
        *("--remount-ro", "/dev"),
        *("--size", size, "--tmpfs", "/tmp"),
    ]


def unavailable_message(reason: str) -> str:
    return (
        f"bubblewrap sandbox unavailable: {reason}. Fix: install it with "
        "`apt-get install -y bubblewrap` and make sure unprivileged user namespaces are "
        "enabled (sysctl user.max_user_namespaces > 0; on Debian/Ubuntu also "
        "kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0), "
        "or run with `--sandbox none` (no filesystem/network isolation; not recommended)."
    )


def prepare_own_tree(workspace: Path) -> None:
    """User mode: mkdir -p, mode 0700; the files are the user's already (no chown)."""
    workspace = Path(workspace).resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    os.chmod(workspace, 0o700)


def probe_bwrap(how: Wrapping | None = None) -> str | None:
    """Run a tiny real sandboxed command with the production flags: root mode as an
    unprivileged uid, user mode as the user. None if it works, else the reason. With
    `nproc_inside` the command runs under RLIMIT_NPROC 2 and still forks (`touch`): that
    holds only where the kernel counts the limit per user namespace (Linux >= 5.14)."""
    how = how or Wrapping(user=os.geteuid() != 0)
    try:
        wrappers, bwrap = host_wrappers(how.user), find_bwrap()
    except SandboxUnavailable as e:
        return str(e)  # already says what is missing and how to fix it
    if how.nproc_inside and not os.access(INNER_PRLIMIT, os.X_OK):
        return f"{INNER_PRLIMIT} is missing (apt-get install -y util-linux)"
    # /tmp rather than $TMPDIR: the probe uid must be able to reach the directory.
    tmp = Path(
        tempfile.mkdtemp(prefix="sandbox-probe-", dir="/tmp" if os.path.isdir("/tmp") else None)
    )
    try:
        os.chmod(tmp, 0o711)
        ws = tmp / "ws"
        prepare_own_tree(ws) if how.user else prepare_tree(ws, PROBE_UID)
        check = 'test "$PWD" = /work && touch /work/probe && ! touch /etc/probe 2>/dev/null'
        argv = bwrap_argv(
            wrappers, bwrap, check, ws, PROBE_UID, Limits(), None, how=how, inner_nproc=2
        )
        return _run_probe(argv, ws)
    except OSError as e:
        return f"sandbox probe failed: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_probe(argv: list[str], ws: Path) -> str | None:
    try:
        p = subprocess.run(
            argv,
            cwd="/",
            env={"PATH": INNER_PATH},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=_PROBE_TIMEOUT_S,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return f"sandboxed probe command did not finish within {_PROBE_TIMEOUT_S:g}s"
    if p.returncode != 0:
        out = p.stdout.decode("utf-8", errors="replace").strip()
        return f"sandboxed probe command failed (exit {p.returncode}): {out or 'no output'}"
    if not (ws / "probe").is_file():
        return "sandboxed probe command did not write to its workspace"
    return None
