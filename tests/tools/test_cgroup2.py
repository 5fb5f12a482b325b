"""cgroup v2 per-agent groups (tools/sandbox/cgroup2.py) against a TEST DOUBLE of the cgroup2
file layout: this host mounts cgroup v1 (the real v1 memory groups are tested with real
processes in test_sandbox.py), so a temp dir plays the cgroup2 mount. The double does the
kernel's part of mkdir and rmdir (a new group gets its interface files; rmdir removes them,
and refuses a group that has children or processes); the code under test writes the same
files it writes on a real cgroup2 mount, and the test reads what it wrote."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from tools.sandbox import Limits
from tools.sandbox.cgroup2 import LEAF, ROOT_SUBTREE, Cgroup2, setup
from tools.sandbox.cgroups import CgroupState, join_argv
from tools.sandbox.enforced import _memory

CONTROLLERS = "cpuset cpu io memory hugetlb pids rdma misc"


class Cgroup2LayoutDouble:
    """Test double of a cgroup2 mount's file layout (not the kernel: writes are plain file
    writes, so a group's cgroup.procs holds the last pid written to it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(exist_ok=True)
        for name, text in self._interface(CONTROLLERS).items():
            (root / name).write_text(text)

    @staticmethod
    def _interface(controllers: str) -> dict[str, str]:
        files = {
            "cgroup.controllers": controllers + "\n",
            "cgroup.subtree_control": "",
            "cgroup.procs": "",
            "cgroup.kill": "",
            "cgroup.events": "populated 0\nfrozen 0\n",
        }
        if "memory" in controllers.split():
            files |= {"memory.max": "max\n", "memory.swap.max": "max\n"}
        if "pids" in controllers.split():
            files["pids.max"] = "max\n"
        return files

    def mkdir(self, path: Path) -> None:
        if path.exists():
            return
        enabled = (path.parent / "cgroup.subtree_control").read_text().split()
        path.mkdir()
        for name, text in self._interface(" ".join(c.lstrip("+") for c in enabled)).items():
            (path / name).write_text(text)

    def rmdir(self, path: Path) -> None:
        if any(p.is_dir() for p in path.iterdir()) or (path / "cgroup.procs").read_text().strip():
            raise OSError(errno.EBUSY, "group busy", str(path))
        for f in path.iterdir():
            f.unlink()
        path.rmdir()

    def group(self, rel: str, owner: int = 0) -> Path:
        """A group below the mount (systemd's slices), its files owned by `owner`."""
        here = self.root
        for part in rel.strip("/").split("/"):
            (here / "cgroup.subtree_control").write_text("+memory +pids")
            self.mkdir(here / part)
            here = here / part
        for p in (here, here / "cgroup.procs", here / "cgroup.subtree_control"):
            os.chown(p, owner, owner)
        return here


def read(p: Path) -> str:
    return p.read_text().strip()


def test_delegated_user_subtree(tmp_path: Path) -> None:
    fs = Cgroup2LayoutDouble(tmp_path / "cgroup")
    own = "/user.slice/user-1000.slice/user@1000.service/app.slice/run.scope"
    scope = fs.group(own, owner=1000)
    (scope / "cgroup.procs").write_text(f"{os.getpid()}\n")
    stale = scope / "concur-999999999.1"  # a dead runner's, with an agent group
    fs.mkdir(stale)
    fs.mkdir(stale / "u7")
    cg = setup(fs.root, own, 1000, fs)
    assert isinstance(cg, Cgroup2), cg
    assert cg.base == scope and cg.controllers == ("memory", "pids")
    assert "delegated to uid 1000" in cg.delegated
    # "no internal processes": ours moved into a leaf before the controllers were enabled
    assert read(scope / LEAF / "cgroup.procs") == str(os.getpid())
    assert read(scope / "cgroup.subtree_control") == "+memory +pids"
    assert read(cg.run_dir / "cgroup.subtree_control") == "+memory +pids"
    assert not stale.exists()

    procs = cg.procs_file(200005, Limits(memory_bytes=256 * 2**20, nproc=32))
    agent = cg.run_dir / "u200005"
    assert procs == str(agent / "cgroup.procs")
    assert read(agent / "memory.max") == str(256 * 2**20)
    assert read(agent / "memory.swap.max") == "0"
    assert read(agent / "pids.max") == "32"
    # the command joins its group itself, before exec: the pid written is the command's
    out = subprocess.run(
        [*join_argv(procs), "/bin/sh", "-c", "echo $$"], capture_output=True, text=True
    )
    assert out.returncode == 0 and read(agent / "cgroup.procs") == out.stdout.strip()

    idle = cg.run_dir / "u200006"
    cg.procs_file(200006, Limits())
    (agent / "cgroup.procs").write_text("")  # that command ended
    cg.close()
    assert not agent.exists() and not idle.exists() and not cg.run_dir.exists()


def test_group_in_use_stays_and_dead_runner_groups_are_killed(tmp_path: Path) -> None:
    fs = Cgroup2LayoutDouble(tmp_path / "cgroup")
    scope = "/user.slice/user-1000.slice/user@1000.service/app.slice/run.scope"
    fs.group(scope, owner=1000)
    own = f"{scope}/{LEAF}"
    leaf = fs.group(own, owner=1000)  # a runner before us made the leaf: base is its parent
    (leaf / "cgroup.procs").write_text(f"{os.getpid()}\n")
    cg = setup(fs.root, own, 1000, fs)
    assert isinstance(cg, Cgroup2) and cg.base == leaf.parent
    cg.procs_file(200001, Limits())
    (cg.run_dir / "u200001" / "cgroup.procs").write_text("424242\n")  # still running
    cg.close()
    assert (cg.run_dir / "u200001").exists()  # not removed under a live process
    # that runner is gone now: the next one kills its group (cgroup.kill) and removes it
    (cg.run_dir / "u200001" / "cgroup.procs").write_text("")
    dead = cg.base / "concur-999999999.1"
    cg.run_dir.rename(dead)
    assert isinstance(setup(fs.root, own, 1000, fs), Cgroup2)
    assert not dead.exists()


def test_root_makes_its_own_subtree(tmp_path: Path) -> None:
    fs = Cgroup2LayoutDouble(tmp_path / "cgroup")
    fs.group("/system.slice/ssh.service")
    cg = setup(fs.root, "/system.slice/ssh.service", 0, fs)
    assert isinstance(cg, Cgroup2), cg
    assert cg.base == fs.root / ROOT_SUBTREE
    assert "+memory +pids" in read(fs.root / "cgroup.subtree_control")
    assert read(cg.base / "cgroup.subtree_control") == "+memory +pids"
    cg.procs_file(200000, Limits(memory_bytes=2**30, nproc=64))
    assert read(cg.run_dir / "u200000" / "memory.max") == str(2**30)
    assert read(cg.run_dir / "u200000" / "pids.max") == "64"
    cg.close()
    assert not cg.run_dir.exists() and cg.base.exists()  # shared by root's runners


def test_not_delegated_says_so_and_how(tmp_path: Path) -> None:
    fs = Cgroup2LayoutDouble(tmp_path / "cgroup")
    own = "/user.slice/user-1000.slice/session-3.scope"
    fs.group(own)  # root's, as systemd leaves a login session's scope
    fs.group("/user.slice/user-1000.slice/user@1000.service", owner=1000)
    why = setup(fs.root, own, 1000, fs)
    assert isinstance(why, str)
    assert "no cgroup v2 subtree is delegated to uid 1000" in why and own in why
    assert "user@1000.service is, but this process does not run inside it" in why
    assert "systemd-run --user --scope -p Delegate=yes" in why
    assert not (fs.root / own.lstrip("/") / LEAF).exists()  # nothing made


def test_no_memory_or_pids_controller(tmp_path: Path) -> None:
    fs = Cgroup2LayoutDouble(tmp_path / "cgroup")
    (fs.root / "cgroup.controllers").write_text("cpu io\n")
    why = setup(fs.root, "/", 0, fs)
    assert isinstance(why, str) and "neither the memory nor the pids controller" in why


@pytest.mark.parametrize(
    ("state", "per", "by"),
    [
        (CgroupState("v2", True, True, "x"), "agent", "cgroup v2 memory.max"),
        (CgroupState("v1", True, False, "x"), "agent", "cgroup v1 memory.limit_in_bytes"),
        (CgroupState("none", False, False, "why"), "process", "RLIMIT_DATA only"),
    ],
)
def test_summary_memory_entry(state: CgroupState, per: str, by: str) -> None:
    got = _memory(state, Limits())
    assert got["per"] == per and got["by"].startswith(by)
