"""The exact workspace size bound (tools/sandbox/workspaces.py), with real tools in real bwrap
sandboxes: each workspace its own tmpfs or loop-mounted ext4 image, where dd, fallocate, python
and git writes fail with ENOSPC at the limit and the usage, read from the filesystem, never
passes it; the messages say so; every mount goes when its workspace does, after a SIGKILL of
the process that made it too. Needs root, bubblewrap, e2fsprogs and the sandbox lock (uids
240000+)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.cli.main import workspace_root
from tests.conftest import ROOT, reachable_by_others, read_jsonl, run_cli, write_jsonl
from tools.core import ToolContext
from tools.gitrepo import ensure_repo
from tools.registry import get_tools
from tools.sandbox import (
    BwrapSandbox,
    Limits,
    UnsandboxedSandbox,
    limits_line,
    make_workspace,
    move_tree,
    remove_tree,
)
from tools.sandbox.workspaces import space, sweep_stale_mounts, workspace_bound

LIMIT = 8 * 2**20
EXACT = ["tmpfs", "ext4"]
_uids = itertools.count(240000)


@pytest.fixture(scope="module")
def root(needs_bwrap) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="disk-bound-test-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    remove_tree(d)


def mounted_under(path: Path) -> list[str]:
    """Mount points at or under `path`, from /proc/mounts."""
    top = str(path)
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return [p for p in points if p == top or p.startswith(top + "/")]


def make_ctx(sb: BwrapSandbox | UnsandboxedSandbox, root: Path, fs: str, **lim) -> ToolContext:
    uid = next(_uids)
    ws = root / f"{fs}-{uid}"
    bound = make_workspace(ws, LIMIT, fs)
    assert bound.fs == fs and bound.exact and bound.limit == LIMIT
    sb.prepare_workspace(ws, uid)
    limits = Limits(**{"timeout_s": 30, "workspace_bytes": LIMIT, "fsize_bytes": 2**30, **lim})
    return ToolContext(ws, uid, sb, limits)


def call(ctx: ToolContext, name: str, **args):
    return asyncio.run(get_tools([name])[name](args, ctx))


def used(ctx: ToolContext) -> int:
    """The usage read from the workspace's filesystem (statvfs), and the blocks its files
    hold (`du`, st_blocks): both at most the limit."""
    bound = workspace_bound(ctx.workspace)
    assert bound is not None
    fs_used = space(ctx.workspace, bound)[0]
    du = subprocess.run(["du", "-s", "-B1", str(ctx.workspace)], capture_output=True, text=True)
    assert int(du.stdout.split()[0]) <= LIMIT
    return fs_used


@pytest.mark.parametrize("fs", EXACT)
def test_dd_fallocate_and_python_stop_at_the_bound(fs: str, root: Path) -> None:
    sb = BwrapSandbox()
    ctx = make_ctx(sb, root, fs)
    o = call(ctx, "bash", command="dd if=/dev/zero of=big bs=4k count=16384")
    assert not o.ok and "dd: error writing 'big': No space left on device" in o.text
    assert f"[workspace full: 8.0 MiB used of its 8.0 MiB limit (its own {fs}" in o.text
    assert o.meta["workspace_full"] and LIMIT - 64 * 1024 < used(ctx) <= LIMIT
    # 1 MiB writes: on ext4 one that does not fit whole fails whole (up to 1 MiB stays free)
    o = call(ctx, "bash", command="rm big && dd if=/dev/zero of=big bs=1M count=64")
    assert not o.ok and "dd: error writing 'big': No space left on device" in o.text
    assert LIMIT - 2**20 <= used(ctx) <= LIMIT
    assert "[workspace full: 8.0" in o.text or "the workspace is limited to 8.0 MiB" in o.text
    o = call(ctx, "bash", command="rm big && fallocate -l 1G fa")
    assert not o.ok and "fallocate failed: No space left on device" in o.text
    assert used(ctx) <= LIMIT and os.path.getsize(ctx.workspace / "fa") <= LIMIT
    assert "limit" in o.text and "8.0 MiB" in o.text  # full, or: ran out of space
    o = call(ctx, "python", code="open('p', 'wb').write(b'x' * (64 << 20))")
    assert not o.ok and "OSError: [Errno 28] No space left on device" in o.text
    assert used(ctx) <= LIMIT and "8.0 MiB" in o.text
    o = call(ctx, "bash", command="rm -f fa p && df --output=size -B1 . | tail -1")
    assert o.ok and "workspace" not in o.text and used(ctx) < 256 * 1024
    asyncio.run(sb.aclose())


def test_mode_none_is_bounded_too(root: Path) -> None:
    """--sandbox none runs commands in the real workspace path: the same mount bounds them."""
    sb = UnsandboxedSandbox()
    ctx = make_ctx(sb, root, "tmpfs")
    o = call(ctx, "bash", command="dd if=/dev/zero of=big bs=4k count=16384")
    assert not o.ok and "No space left on device" in o.text and o.meta["workspace_full"]
    assert used(ctx) <= LIMIT
    asyncio.run(sb.aclose())


@pytest.mark.parametrize("fs", EXACT)
def test_git_and_submit_under_the_bound(fs: str, root: Path) -> None:
    sb = BwrapSandbox()
    ctx = make_ctx(sb, root, fs)
    assert "base" in asyncio.run(ensure_repo(ctx))
    o = call(ctx, "bash", command="echo 'print(1)' > a.py && git add a.py && git status -s")
    assert o.ok and "A  a.py" in o.text
    o = call(ctx, "bash", command="head -c 30000000 /dev/urandom > fill")  # fills it
    assert not o.ok and o.meta["workspace_full"] and used(ctx) <= LIMIT
    o = call(ctx, "submit", answer="done")  # the patch is staged in /tmp, not the workspace
    assert o.submitted and "Patch captured: 2 file(s) changed" in o.text
    assert "+print(1)" in ctx.state["patch"]["diff"]
    assert "[workspace" not in ctx.state["patch"]["diff"]  # the sandbox's note is not in it
    call(ctx, "bash", command="rm -rf .git")
    o = call(ctx, "submit")
    assert o.submitted and "the workspace has no .git any more" in o.text
    assert "was .git removed" not in o.text
    asyncio.run(sb.aclose())


def test_removal_and_keeping_unmount(root: Path) -> None:
    spaces = {fs: root / f"rm-{fs}" for fs in EXACT}
    loops = loops_of(root)  # those of the other tests' workspaces
    for fs, ws in spaces.items():
        make_workspace(ws, LIMIT, fs)
        (ws / "f").write_text("x")
        assert mounted_under(ws) == [str(ws)]
    remove_tree(spaces["tmpfs"])
    assert not mounted_under(spaces["tmpfs"]) and not spaces["tmpfs"].exists()
    kept = root / "kept"
    kept.mkdir()
    move_tree(spaces["ext4"], kept / "ws")  # --keep-workspaces: copied out, then unmounted
    assert (kept / "ws" / "f").read_text() == "x" and not mounted_under(spaces["ext4"])
    assert not spaces["ext4"].exists() and workspace_bound(spaces["ext4"]) is None
    assert loops_of(root) == loops  # the image's loop device is freed with the mount


def loops_of(path: Path) -> list[str]:
    """Loop devices whose backing file was under `path`."""
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(path) in line]


def test_sigkilled_maker_leaves_nothing_after_the_sweep(root: Path) -> None:
    """A process that mounted workspaces is SIGKILLed: its mounts stay (nothing unmounts them
    in the kernel), and the next runner's sweep unmounts them and detaches their loop devices,
    one never mounted included."""
    folder = root / "killed"
    code = f"""
import os, subprocess, time
from pathlib import Path
from tools.sandbox import make_workspace
from tools.sandbox.workspaces import _owner_tag
d = Path({str(folder)!r})
for fs in ("tmpfs", "ext4"):
    make_workspace(d / fs, {LIMIT}, fs)
# as if killed inside `mount -o loop`: a loop device of a tagged image, never mounted
img = d / f".{{_owner_tag()}}.x.img"
img.write_bytes(bytes(2**20))
subprocess.run(["losetup", "-f", str(img)], check=True)
img.unlink()
print("ready", flush=True)
time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        assert len(mounted_under(folder)) == 2 and len(loops_of(folder)) == 2
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert len(mounted_under(folder)) == 2  # what a killed runner leaves
    assert sweep_stale_mounts() >= 3
    assert not mounted_under(folder) and not loops_of(folder)
    assert not list(folder.iterdir())  # the mount points are gone too


def python_as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` from the checkout as the real unprivileged user nobody."""
    return subprocess.run(
        reachable_by_others(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             sys.executable, "-c", code]),
        cwd=ROOT, capture_output=True, text=True, check=True,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_not_root_falls_back_to_the_watch(tmp_path: Path) -> None:
    """A real unprivileged user cannot mount: the workspace is a plain directory, and the
    bound says why it is not exact."""
    d = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chown(d, 65534, 65534)
        code = (
            "import json; from pathlib import Path; from tools.sandbox import make_workspace; "
            f"b = make_workspace(Path({str(d)!r}) / 'ws', {LIMIT}, 'tmpfs'); "
            "print(json.dumps([b.fs, b.exact, b.why]))"
        )
        out = python_as_nobody(code)
        fs, exact, why = json.loads(out.stdout)
        assert (fs, exact) == ("watch", False) and why.startswith("not root")
        assert "not on their own tmpfs filesystem" in out.stderr  # said in the log
        assert (d / "ws").is_dir() and not mounted_under(d)
    finally:
        remove_tree(d)


def test_batch_reports_the_full_workspace_and_its_bound(tmp_path: Path, needs_bwrap) -> None:
    """A real run.py: an agent fills its workspace past the 256 MiB default; the observation
    names the limit, submit still captures the patch, summary.json says the bound was exact,
    and no mount is left."""

    def step(name: str, **args: str) -> str:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    # files of 15 MB (RLIMIT_FSIZE is 16 MiB a file) until the workspace is full
    fill = "echo hi > a; for i in $(seq 20); do head -c 15000000 /dev/zero > f$i || break; done"
    steps = [step("bash", command=fill), step("submit", answer="done")]
    tasks = write_jsonl(tmp_path / "t.jsonl", [{"id": "fill", "prompt": "p", "replay": steps}])
    out = tmp_path / "out"
    run_cli("--tasks", str(tasks), "--out", str(out), "--engine", "replay", "-q")
    (rec,) = read_jsonl(out / "trajectories.jsonl")
    text = json.dumps(rec)
    assert "error writing 'standard output': No space left on device" in text
    assert "[workspace full: 256.0 MiB used of its 256.0 MiB limit (its own tmpfs" in text
    # captured (cut at 1 MiB: 18 binary files of zeros do not fit), though the workspace is full
    assert rec["patch"]["files"] >= 2 and "+hi" in rec["patch"]["diff"]
    bound = json.loads((out / "summary.json").read_text())["workspace_bound"]
    assert bound["exact"] and bound["workspaces"] == {"tmpfs": 1}
    assert bound["limit_bytes"] == 256 * 2**20
    assert not mounted_under(workspace_root(out))


@pytest.mark.parametrize("mib", [1, 3, 256, 1024])
def test_every_size_is_exact(mib: int, root: Path) -> None:
    """Whatever the limit, the filesystem holds exactly that much: tmpfs by its size, the ext4
    image by its reserve (its root directory's block included)."""
    for fs in EXACT:
        ws = root / f"size-{fs}-{mib}"
        bound = make_workspace(ws, mib * 2**20, fs)
        assert bound.exact and bound.limit == mib * 2**20
        used_now, free = space(ws, bound)
        assert used_now + free == bound.limit and used_now <= 4096
        remove_tree(ws)
        assert not mounted_under(ws)


@pytest.mark.parametrize("fs", ["tmpfs", "ext4", "watch"])
def test_start_up_line_probes_the_bound(fs: str, needs_bwrap) -> None:
    """The start-up log's workspace bound comes from a workspace really made (and removed)
    of the kind asked for, not from a guess; the probe leaves no mount and no folder."""
    before = set(Path(tempfile.gettempdir()).glob("concur-ws-probe-*"))
    line = limits_line(BwrapSandbox(False), Limits(), fs)
    want = "watched (asked for)" if fs == "watch" else f"exact ({fs})"
    assert line.endswith(f"workspace {Limits().workspace_bytes // 2**20} MiB, {want}"), line
    assert set(Path(tempfile.gettempdir()).glob("concur-ws-probe-*")) == before
    assert not [m for m in mounted_under(Path(tempfile.gettempdir())) if "probe" in m]


def test_start_up_line_says_why_not_exact_when_not_root(needs_bwrap) -> None:
    """As a real unprivileged user the probe cannot mount: the line says watched, and why."""
    code = (
        "from tools.sandbox import Limits, limits_line, make_sandbox; "
        "print(limits_line(make_sandbox('bwrap-user'), Limits(), 'tmpfs'))"
    )
    out = python_as_nobody(code)
    assert out.stdout.strip().endswith("MiB, watched (not root: only root can mount a "
                                       "filesystem per workspace)"), out.stdout  # fmt: skip


def test_start_up_line_on_a_full_temporary_folder(tmp_path: Path, needs_bwrap) -> None:
    """A real full tmpfs as the temporary folder: the probe cannot even make its folder; the
    start-up line says so, naming the folder and the error, instead of a traceback."""
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=2", "none", str(full)],
                   check=True)  # fmt: skip
    try:
        (full / "taken").mkdir()  # the last inode
        # the folder the process chose earlier (tempfile keeps it), full by now
        code = (
            f"import tempfile; tempfile.tempdir = {str(full)!r}; "
            "from tools.sandbox import BwrapSandbox, Limits, limits_line; "
            "print(limits_line(BwrapSandbox(False), Limits(), 'tmpfs'))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        )
        line = out.stdout.strip()
        assert f"MiB, watched (no probe workspace in {full}: [Errno 28] No space left" in line
        assert line.endswith(")") and "Traceback" not in out.stderr, out
    finally:
        subprocess.run(["umount", str(full)], check=True)
