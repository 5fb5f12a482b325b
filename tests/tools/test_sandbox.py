"""Real-bwrap tests of tools.sandbox: no mocks. Needs root (to drop to per-test uids) and
bubblewrap. Each test uses its own uid (210000 + n) so `pgrep -u` checks cannot interfere."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tools.sandbox import (
    AGENT_UID_BASE,
    BwrapSandbox,
    ExecResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    UnsandboxedSandbox,
    make_sandbox,
    move_tree,
    probe_bwrap,
    remove_tree,
)

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="sandbox tests must run as root: they drop to per-test uids with setpriv",
    ),
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bubblewrap is not installed (apt-get install -y bubblewrap)",
    ),
]

UID = 210000


def workspace(sb: Sandbox, base: Path, uid: int) -> Path:
    ws = base / f"ws{uid}"
    sb.prepare_workspace(ws, uid)
    return ws


async def run(
    sb: Sandbox, base: Path, uid: int, command: str, stdin: str | None = None, **limits: Any
) -> ExecResult:
    ws = workspace(sb, base, uid)
    return await sb.run(command, ws, uid, Limits(**limits), stdin=stdin)


def procs_of(uid: int) -> str:
    p = subprocess.run(["pgrep", "-a", "-u", str(uid)], capture_output=True, text=True)
    return p.stdout


async def running(uid: int, what: str, within: float = 30.0) -> None:
    """Wait until a process of `uid` runs `what`: on a loaded machine a sandbox can take
    longer to start than any fixed sleep (0.33 s measured beside 8 busy loops)."""
    deadline = time.monotonic() + within
    while what not in procs_of(uid):
        assert time.monotonic() < deadline, f"{what!r} did not start within {within}s"
        await asyncio.sleep(0.02)


async def test_echo_and_exit_codes(sb: BwrapSandbox, base: Path) -> None:
    r = await run(sb, base, UID + 1, "echo hello; echo oops >&2")
    assert (r.exit_code, r.output, r.timed_out, r.truncated) == (0, "hello\noops\n", False, False)
    assert r.seconds < 5
    assert (await run(sb, base, UID + 1, "exit 7")).exit_code == 7
    # Not `kill -KILL $$`: the command is the namespace's pid 1, immune to its own signals.
    assert (await run(sb, base, UID + 1, "bash -c 'kill -KILL $$'; exit $?")).exit_code == 137
    assert (await run(sb, base, UID + 1, "tr a-z A-Z", stdin="abc\n")).output == "ABC\n"


async def test_cwd_env_and_ownership(
    sb: BwrapSandbox, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid = UID + 2
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "leaked")
    assert sb.WORKDIR == "/work" and sb.workdir(base) == "/work"
    r = await run(sb, base, uid, "pwd; id -u; id -G; echo hi > made.txt; mkdir d; env | sort")
    lines = r.output.splitlines()
    assert lines[:3] == ["/work", str(uid), str(uid)], r.output
    env = dict(line.split("=", 1) for line in lines[3:])
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert env["HOME"] == "/work" and env["TMPDIR"] == "/tmp"
    assert env["LANG"] == "C.UTF-8" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "SANDBOX_TEST_SECRET" not in env
    ws = base / f"ws{uid}"
    for p in (ws / "made.txt", ws / "d"):
        assert (p.stat().st_uid, p.stat().st_gid) == (uid, uid)
    assert (ws / "made.txt").read_text() == "hi\n"


def test_prepare_workspace(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 3
    ws = base / "prep" / "a" / "ws"
    outside = base / "outside.txt"
    outside.write_text("root's")
    ws.mkdir(parents=True)
    (ws / "f").write_text("x")
    (ws / "link").symlink_to(outside)
    (base / "prep").chmod(0o755)
    (base / "prep" / "a").chmod(0o755)
    sb.prepare_workspace(ws, uid)
    st = ws.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, uid, 0o700)
    assert (ws / "f").stat().st_uid == uid
    assert outside.stat().st_uid == 0  # the symlink was not followed
    # A parent the uid cannot search is reported up front, with the fix.
    closed = base / "closed"
    closed.mkdir(mode=0o700)
    with pytest.raises(PermissionError, match="chmod o\\+x"):
        sb.prepare_workspace(closed / "ws", uid)


async def test_filesystem_confined(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 4
    fd, host_tmp = tempfile.mkstemp(prefix="host-only-", dir="/tmp")
    os.close(fd)
    os.chmod(host_tmp, 0o644)
    inside_tmp = f"/tmp/inside-only-{uid}"
    script = f"""
        for p in /etc/x /usr/x /x /dev/x /usr/bin/x /proc/x; do
            touch $p 2>/dev/null && echo "WROTE $p"
        done
        cat /etc/shadow >/dev/null 2>&1 && echo "READ shadow"
        ls /root >/dev/null 2>&1 && echo "SAW /root"
        ls /home /var /run /srv >/dev/null 2>&1 && echo "SAW host dirs"
        test -e {host_tmp} && echo "SAW host tmp"
        echo private > {inside_tmp} && cat {inside_tmp}
        echo shm > /dev/shm/x && echo shm-ok
    """
    try:
        r = await run(sb, base, uid, script)
        assert r.output == "private\nshm-ok\n", r.output
        assert not os.path.exists(inside_tmp)
    finally:
        os.unlink(host_tmp)
    # /tmp is a size-limited tmpfs: filling it fails instead of eating host memory.
    r = await run(sb, base, uid, "head -c 3000000 /dev/zero > /tmp/big", tmp_bytes=1 << 20)
    assert r.exit_code != 0 and "No space left" in r.output


async def test_no_network(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 5
    with socket.socket() as srv, socket.socket(socket.AF_UNIX) as usrv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.setblocking(False)
        port = srv.getsockname()[1]
        abstract = f"\0sandbox-test-{os.getpid()}"
        usrv.bind(abstract)
        usrv.listen()
        script = workspace(sb, base, uid) / "net.py"
        script.write_text(
            textwrap.dedent(f"""
            import socket
            print(sorted(name for _, name in socket.if_nameindex()))
            for fam, addr in ((socket.AF_INET, ("127.0.0.1", {port})),
                              (socket.AF_UNIX, {abstract!r})):
                s = socket.socket(fam)
                s.settimeout(2)
                try:
                    s.connect(addr)
                    print("CONNECTED", fam)
                except OSError as e:
                    print("blocked", type(e).__name__)
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=2)
                print("CONNECTED internet")
            except OSError as e:
                print("blocked", type(e).__name__)
        """)
        )
        r = await run(sb, base, uid, "python3 net.py; ls /sys/class/net 2>/dev/null")
        with pytest.raises(BlockingIOError):
            srv.accept()
    assert r.exit_code in (0, 2), r.output
    assert r.output.splitlines()[0] == "['lo']", r.output
    assert "CONNECTED" not in r.output
    assert r.output.count("blocked") == 3, r.output


async def test_no_privileges(sb: BwrapSandbox, base: Path) -> None:
    r = await run(sb, base, UID + 6, "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    assert "CapEff:\t0000000000000000" in r.output
    assert "CapBnd:\t0000000000000000" in r.output
    assert "NoNewPrivs:\t1" in r.output
    if shutil.which("unshare"):
        r = await run(sb, base, UID + 6, "unshare -U -r true && echo NESTED-USERNS")
        assert "NESTED-USERNS" not in r.output and r.exit_code != 0


async def test_fork_bomb_contained(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 7
    count = textwrap.dedent("""
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(n, e.errno)
    """)
    r = await run(sb, base, uid, f"python3 -c '{count}'", nproc=24)
    n, errno_ = map(int, r.output.split())
    assert n < 24 and errno_ == 11, r.output  # EAGAIN at the nproc limit
    assert procs_of(uid) == ""  # the 30 s sleepers died with the namespace
    r = await run(sb, base, uid, ":(){ :|:& };:; sleep 1", nproc=32, timeout_s=10)
    assert r.seconds < 10
    assert procs_of(uid) == ""


async def test_memory_bomb(sb: BwrapSandbox, base: Path) -> None:
    code = "x = []\nwhile True: x.append(bytearray(10**7))"
    r = await run(sb, base, UID + 8, f"python3 -c '{code}'", data_bytes=256 << 20)
    assert r.exit_code == 1 and "MemoryError" in r.output, r.output
    r = await run(sb, base, UID + 8, "python3 -c 'bytearray(4 << 30)'", data_bytes=256 << 20)
    assert "MemoryError" in r.output


async def test_cpu_limit(sb: BwrapSandbox, base: Path) -> None:
    r = await run(sb, base, UID + 9, "python3 -c 'while True: pass'", cpu_s=1)
    assert r.exit_code == 137 and not r.timed_out and r.seconds < 5


async def test_timeout_kills_everything(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 10
    cmd = "setsid sleep 1000 & nohup sleep 1000 >/dev/null 2>&1 & sleep 1000"
    r = await run(sb, base, uid, cmd, timeout_s=1)
    assert r.timed_out and r.exit_code is None
    assert 1 <= r.seconds < 4
    assert procs_of(uid) == ""


async def test_output_flood_capped(sb: BwrapSandbox, base: Path) -> None:
    r = await run(sb, base, UID + 11, "head -c 50000000 /dev/zero | tr '\\0' a; echo done >&2")
    assert r.exit_code == 0 and r.truncated and not r.timed_out
    assert r.seconds < 10
    head, marker = r.output[: 32 * 1024], r.output[32 * 1024 :]
    assert set(head) == {"a"}
    dropped = 50_000_000 + len("done\n") - 32 * 1024
    assert marker == f"\n[... output truncated: {dropped} more bytes not shown ...]"


async def test_file_size_limit(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 12
    r = await run(sb, base, uid, "head -c 5000000 /dev/zero > big", fsize_bytes=1 << 20)
    assert r.exit_code != 0
    assert (base / f"ws{uid}" / "big").stat().st_size <= 1 << 20


async def test_workspace_bound_flagged(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 13
    r = await run(sb, base, uid, "for i in 1 2 3; do head -c 1000000 /dev/zero > f$i; done")
    assert r.exit_code == 0 and not r.workspace_over_limit
    r = await run(sb, base, uid, "true", workspace_bytes=2_000_000)
    assert r.workspace_over_limit and "workspace over its size limit" in r.output
    r = await run(sb, base, uid, "rm f1 f2", workspace_bytes=2_000_000)
    assert not r.workspace_over_limit and r.output == ""


async def test_cancel_kills_process_group(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 14
    ws = workspace(sb, base, uid)

    async def main() -> None:
        task = asyncio.create_task(sb.run("setsid sleep 100 & sleep 100", ws, uid))
        await running(uid, "sleep 100")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert procs_of(uid) == ""
        # And through asyncio.wait_for, the usual way a caller cancels.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sb.run("sleep 100", ws, uid), 0.3)
        assert procs_of(uid) == ""

    await main()


async def test_aclose_kills_running(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 15
    ws = workspace(sb, base, uid)

    async def main() -> None:
        own = BwrapSandbox()
        task = asyncio.create_task(own.run("sleep 100", ws, uid))
        await running(uid, "sleep 100")
        await own.aclose()
        await own.aclose()  # idempotent
        assert procs_of(uid) == ""
        r = await task
        assert r.exit_code == 137 and not r.timed_out

    await main()


async def test_concurrent_distinct_uids(sb: BwrapSandbox, base: Path) -> None:
    uids = [UID + 100 + i for i in range(20)]
    spaces = {u: workspace(sb, base, u) for u in uids}

    async def main() -> list[ExecResult]:
        return await asyncio.gather(
            *(sb.run("sleep 0.3; echo ok $(id -u) > out; cat out", spaces[u], u) for u in uids)
        )

    results = await main()
    for u, r in zip(uids, results, strict=True):
        assert (r.exit_code, r.output) == (0, f"ok {u}\n")


async def test_python_and_pytest_inside(sb: BwrapSandbox, base: Path) -> None:
    uid = UID + 16
    ws = workspace(sb, base, uid)
    (ws / "test_tiny.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    os.chown(ws / "test_tiny.py", uid, uid)
    r = await run(
        sb, base, uid, "python3 -c 'import ssl, sqlite3, json, venv; print(\"imports ok\")'"
    )
    assert r.output == "imports ok\n", r.output
    r = await run(sb, base, uid, "python3 -m pytest -q test_tiny.py")
    assert r.exit_code == 0 and "1 passed" in r.output, r.output


@pytest.mark.skipif(not os.path.exists("/usr/bin/git"), reason="git is not installed")
async def test_git_inside(sb: BwrapSandbox, base: Path) -> None:
    cmd = (
        "echo hi > a.txt && git init -q && git add -A && "
        "git -c user.email=a@b -c user.name=a commit -qm x && echo more >> a.txt && git diff"
    )
    r = await run(sb, base, UID + 17, cmd)
    assert r.exit_code == 0 and "+more" in r.output, r.output


def test_probe_and_make_sandbox() -> None:
    assert probe_bwrap() is None
    assert make_sandbox("bwrap").mode == "bwrap"
    with pytest.raises(ValueError, match=r"bwrap.*none"):
        make_sandbox("bogus")
    assert issubclass(SandboxUnavailable, RuntimeError)
    assert AGENT_UID_BASE == 200000


async def test_none_mode(base: Path, caplog: pytest.LogCaptureFixture) -> None:
    uid = UID + 18
    with caplog.at_level(logging.WARNING, logger="concur.sandbox"):
        sb = make_sandbox("none")
    assert isinstance(sb, UnsandboxedSandbox) and sb.mode == "none"
    assert any("SANDBOX DISABLED" in rec.getMessage() for rec in caplog.records)
    ws = workspace(sb, base, uid)
    r = await run(sb, base, uid, "pwd; id -u; echo $HOME; ulimit -u; setsid sleep 100 & echo bg")
    assert r.output.splitlines() == [str(ws), str(uid), str(ws), "64", "bg"], r.output
    assert sb.workdir(ws) == str(ws)
    # The per-uid sweep after the command killed the setsid escapee (zombies may remain
    # until the host's init reaps them: state Z).
    states = subprocess.run(
        ["ps", "-o", "stat=", "-u", str(uid)], capture_output=True, text=True
    ).stdout.split()
    assert all(s.startswith("Z") for s in states), states
    r = await run(sb, base, uid, "sleep 100", timeout_s=0.5)
    assert r.timed_out and r.exit_code is None and r.seconds < 3


async def test_deep_and_linked_trees_are_bounded_not_fatal(sb: BwrapSandbox, base: Path) -> None:
    # 1,100 nested directories: deeper than Python's recursion limit and than the walk bound
    uid = UID + 40
    r = await run(sb, base, uid, "for i in $(seq 1100); do mkdir d && cd d; done; echo made")
    assert r.workspace_over_limit  # too deep to walk: counts as over (and the watch kills it)
    deep = base / f"ws{uid}"
    # the whole 1,100 levels on the host too, in one process (a mkdir per level took 31 s on
    # a loaded machine)
    levels = "/".join(["d"] * 1100)
    subprocess.run(["mkdir", "-p", levels], cwd=deep, check=True)
    assert (deep / levels).is_dir()
    remove_tree(deep)  # no RecursionError (shutil.rmtree would raise), nothing left
    assert not deep.exists()
    # every hard-link name costs a block: 2,000 links to one byte are 8 MB, not 1 byte
    uid = UID + 41
    r = await run(
        sb,
        base,
        uid,
        "echo x > f; for i in $(seq 2000); do ln f l$i; done",
        workspace_bytes=4_000_000,
    )
    assert r.workspace_over_limit


async def test_no_pseudo_terminals(sb: BwrapSandbox, base: Path) -> None:
    # all sandboxes share the kernel's pty pool: none may take from it
    r = await run(sb, base, UID + 42, "python3 -c 'import os; os.openpty()' 2>&1; echo done")
    assert "PermissionError" in r.output and "done" in r.output


def test_move_tree_keeps_owner_and_never_follows_links(base: Path, tmp_path: Path) -> None:
    src = base / "mv-src"
    src.mkdir()
    (src / "f").write_text("x")
    os.symlink("/etc/shadow", src / "link")
    os.chown(src / "f", UID + 43, UID + 43)
    other = Path("/dev/shm") / f"concur-mv-{os.getpid()}"  # another filesystem: cp -a path
    other.mkdir()
    try:
        move_tree(src, other / "dst")
        dst = other / "dst"
        assert not src.exists()
        assert (dst / "f").stat().st_uid == UID + 43  # not root
        assert os.readlink(dst / "link") == "/etc/shadow"  # a link, still, not a copy of it
    finally:
        remove_tree(other)


async def test_agent_memory_is_bounded_shared_mappings_included(
    sb: BwrapSandbox, base: Path
) -> None:
    # RLIMIT_DATA ignores MAP_SHARED: only the agent's memory cgroup stops this
    if not (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()):
        pytest.fail("this machine has no cgroup v1 memory controller; the test needs one")
    code = (
        "import mmap\nm = mmap.mmap(-1, 1 << 30)\n"
        "for i in range(0, 1 << 30, 4096): m[i] = 1\nprint('survived')\n"
    )
    r = await run(sb, base, UID + 44, "python3 -; echo rc=$?", stdin=code, memory_bytes=256 * 2**20)
    assert "survived" not in r.output and "rc=137" in r.output
    r = await run(sb, base, UID + 44, "echo fine")  # the agent goes on after the kill
    assert r.output.strip() == "fine"


async def test_user_mode_sweep_repeats_while_it_finds_processes() -> None:
    """A process forked while a pass ran is caught by the next pass; at most three."""
    from tools.sandbox.processes import sweep_until_none

    for found, calls in (([2, 1, 0], 3), ([0], 1), ([4, 0], 2), ([5] * 9, 3)):
        left = iter(found)
        seen: list[int] = []

        def kill(left: Any = left, seen: list[int] = seen) -> int:
            seen.append(n := next(left))
            return n

        await sweep_until_none(kill)
        assert len(seen) == calls, (found, seen)
