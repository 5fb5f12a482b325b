"""Non-root mode with a REAL unprivileged user: the quick start's batch (shipped SWE tasks,
replay engine) run as an ordinary user, whose agents run in bubblewrap in an unprivileged user
namespace per command; `--sandbox none`; refusals; a SIGKILLed run and a dead run's leftover.

The user (USER, made with useradd when missing) runs `run.py` from this checkout through
setpriv. Where the interpreter lives under a directory others cannot enter (pyenv under /root
here), the user's process gets a private mount namespace in which that directory is an empty
tmpfs with only the interpreter's tree bound back: the user can run Python, and sees nothing
else of it. These start real sandboxes: run under `flock /tmp/concur-sandbox.lock`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.cli.main import workspace_root
from tests.conftest import ROOT, SWE, reachable_by_others, read_jsonl, write_jsonl
from tests.tools.test_attacks import Listener, bash, python, tool_call

USER = "concur-nonroot"
FAST = ["--engine", "replay", "--policy", "none", "--control-period", "0.5", "-q"]
FORKS = (
    "import os, time\n"
    "n = 0\n"
    "while n < 500:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(2)\n"
    "        os._exit(0)\n"
    "    n += 1\n"
    "print('forked', n)\n"
)


@pytest.fixture(scope="module")
def user() -> Iterator[pwd.struct_passwd]:
    assert os.geteuid() == 0, "these tests make a user and switch to it: run them as root"
    made = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True)
        made = True
    entry = pwd.getpwnam(USER)
    yield entry
    subprocess.run(["pkill", "-KILL", "-u", USER], check=False)
    if made:
        subprocess.run(["userdel", "--remove", USER], check=False, capture_output=True)


@pytest.fixture
def home(user: pwd.struct_passwd) -> Iterator[Path]:
    """A folder of the user's for datasets and run folders."""
    d = Path(tempfile.mkdtemp(prefix="nonroot-", dir="/tmp"))
    os.chown(d, user.pw_uid, user.pw_gid)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_user(user: pwd.struct_passwd, *argv: str) -> list[str]:
    """argv running `argv` as the user (its groups, a clean environment)."""
    switch = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
    env = ["env", "-i", f"HOME={user.pw_dir}", f"USER={user.pw_name}", "PATH=/usr/bin:/bin"]
    env += [f"PYTHONPATH={ROOT}", "PYTHONUNBUFFERED=1"]
    return reachable_by_others([*switch, "--", *env, *argv])


def run_as(
    user: pwd.struct_passwd, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    argv = as_user(user, sys.executable, str(ROOT / "run.py"), *args)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def user_processes(user: pwd.struct_passwd) -> list[str]:
    """The user's live processes. Not zombies: a killed escapee of mode none is re-parented to
    the host's init, which reaps it when it gets to it (docs/sandbox.md)."""
    ps = ["ps", "-u", str(user.pw_uid), "-o", "stat=,pid=,args="]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if not line.lstrip().startswith("Z")]


def wait_until(what: str, check, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)


def swe_task(n: int) -> dict:
    return json.loads(SWE.read_text().splitlines()[n])


def isolation_tasks(home: Path, ws_root: Path, port: int) -> list[dict]:
    """Three shipped SWE tasks; each agent writes a secret into its workspace, then looks
    for the others', the user's home and the host's network, forks until refused, submits."""
    tasks = []
    for n in range(3):
        t = swe_task(n)
        others = " ".join(f"{ws_root}/{swe_task(k)['id']}" for k in range(3) if k != n)
        t["replay"] = [
            bash(f"echo secret-{n} > secret.txt; id -u; ulimit -u"),
            bash(
                f"for d in {others} {home} /home /root /tmp/concur-ws-*; do "
                'ls "$d" >/dev/null 2>&1 && echo "SEES $d"; done; '
                "cat /work/../*/secret.txt 2>/dev/null | grep -v secret-" + str(n) + "; "
                "echo looked"
            ),
            python(
                "import socket\n"
                f"for host in ('127.0.0.1', '1.1.1.1'):\n"
                "    try:\n"
                f"        socket.create_connection((host, {port}), timeout=2)\n"
                "        print(host, 'CONNECTED')\n"
                "    except OSError as e:\n"
                "        print(host, 'blocked')\n"
            ),
            python(FORKS),
            tool_call("submit", answer="done"),
        ]
        t["max_steps"] = 6
        tasks.append(t)
    return tasks


def observations(record: dict) -> list[str]:
    return [s["observation"] for s in record["step_log"]]


def test_quick_start_as_an_ordinary_user(user: pwd.struct_passwd, home: Path) -> None:
    out = home / "out"
    ws_root = workspace_root(out)
    listener = Listener()
    try:
        tasks = write_jsonl(home / "swe.jsonl", isolation_tasks(home, ws_root, listener.port))
        os.chown(tasks, user.pw_uid, user.pw_gid)
        p = run_as(user, "--tasks", str(tasks), "--out", str(out), *FAST)
    finally:
        listener.close()
    assert p.returncode == 0, p.stderr[-3000:]
    records = {r["task_id"]: r for r in read_jsonl(out / "trajectories.jsonl")}
    assert len(records) == 3 and {r["status"] for r in records.values()} == {"submitted"}
    for r in records.values():
        ident, looked, net, forks = observations(r)[:4]
        assert ident.split()[:2] == [str(user.pw_uid), "64"], ident  # the user's own uid
        assert "SEES" not in looked and "secret-" not in looked and "looked" in looked, looked
        assert "CONNECTED" not in net and net.count("blocked") == 2, net
        # 64 processes per command: the python tool's bash, python3 and 62 children
        assert "forked 62" in forks, forks
        assert r["eval"]["exit_code"] is not None  # the eval ran in the sandbox too
    assert listener.accepted == 0
    limits = json.loads((out / "summary.json").read_text())["limits"]
    assert limits["sandbox"] == "user" and limits["network"].startswith("none")
    assert limits["processes"]["per"] == "command" and limits["processes"]["max"] == 64
    assert limits["memory"]["per"] in ("agent", "process")  # agent: a delegated cgroup
    assert limits["workspace"]["bound"] in ("watched", "exact")
    assert "sandbox user mode" in (out / "run.log").read_text()
    assert not ws_root.exists() and not user_processes(user)
    assert (out / "trajectories.jsonl").stat().st_uid == user.pw_uid


def test_sandbox_none_as_an_ordinary_user(user: pwd.struct_passwd, home: Path) -> None:
    t = swe_task(0) | {
        "replay": [
            bash("id -u; setsid sleep 30 >/dev/null 2>&1 & echo started"),
            tool_call("submit"),
        ]
    }
    tasks = write_jsonl(home / "one.jsonl", [t])
    os.chown(tasks, user.pw_uid, user.pw_gid)
    out = home / "none"
    p = run_as(user, "--tasks", str(tasks), "--out", str(out), "--sandbox", "none", *FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SANDBOX DISABLED" in p.stderr
    (r,) = read_jsonl(out / "trajectories.jsonl")
    assert r["status"] == "submitted" and observations(r)[0].split()[0] == str(user.pw_uid)
    limits = json.loads((out / "summary.json").read_text())["limits"]
    assert limits["sandbox"] == "none" and limits["network"] == "host"
    assert limits["processes"]["per"] == "batch"
    # the setsid'd sleep left the command's process group: swept by the agent's mark
    assert not user_processes(user)


def test_a_workspace_an_agent_locked_is_removed_as_a_user(
    user: pwd.struct_passwd, home: Path
) -> None:
    # as root rm removes a chmod 000 directory; as the user only after making it ours again
    t = swe_task(0) | {
        "replay": [bash("mkdir -p locked/deep && touch locked/deep/f && chmod 000 locked"),
                   tool_call("submit")]
    }  # fmt: skip
    tasks = write_jsonl(home / "locked.jsonl", [t])
    os.chown(tasks, user.pw_uid, user.pw_gid)
    out = home / "locked"
    p = run_as(user, "--tasks", str(tasks), "--out", str(out), "--sandbox", "none", *FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "could not remove" not in p.stderr, p.stderr[-3000:]
    (r,) = read_jsonl(out / "trajectories.jsonl")
    assert r["status"] == "submitted"
    assert not workspace_root(out).exists()


def test_refusals_leave_no_run_folder(user: pwd.struct_passwd, home: Path) -> None:
    tasks = write_jsonl(home / "one.jsonl", [swe_task(0) | {"replay": [tool_call("submit")]}])
    os.chown(tasks, user.pw_uid, user.pw_gid)
    out = home / "refused"
    p = run_as(user, "--tasks", str(tasks), "--out", str(out), "--sandbox", "bwrap-root", *FAST)
    assert p.returncode == 2 and "must be started as root" in p.stderr, p.stderr
    assert not out.exists()
    # and as root, user mode would be uid 0 on the host: refused too
    argv = [sys.executable, str(ROOT / "run.py"), "--tasks", str(tasks), "--out", str(out)]
    p = subprocess.run([*argv, "--sandbox", "bwrap-user", *FAST], capture_output=True, text=True)
    assert p.returncode == 2 and "as root that is uid 0" in p.stderr, p.stderr
    assert not out.exists()


def test_sigkill_of_a_users_run_leaves_nothing(user: pwd.struct_passwd, home: Path) -> None:
    tasks = [swe_task(n) | {"replay": [bash("sleep 600"), tool_call("submit")]} for n in range(2)]
    data = write_jsonl(home / "kill.jsonl", tasks)
    os.chown(data, user.pw_uid, user.pw_gid)
    out = home / "killed"
    argv = as_user(user, sys.executable, str(ROOT / "run.py"), "--tasks", str(data))
    proc = subprocess.Popen([*argv, "--out", str(out), *FAST], cwd=ROOT)
    try:
        wait_until(
            "both agents in sleep 600",
            lambda: sum("sleep 600" in p for p in user_processes(user)) >= 2,
            timeout=60,
        )
        proc.send_signal(signal.SIGKILL)  # the runner itself (setpriv and env exec it)
        proc.wait()
        wait_until("no process of the user", lambda: not user_processes(user))
        wait_until("no workspace", lambda: not workspace_root(out).exists())
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_runs_leftover_is_killed_on_start(user: pwd.struct_passwd, home: Path) -> None:
    # a process marked by a run that is gone (its runner pid does not exist), in its own
    # session: what a runner killed together with its reaper could leave
    left = subprocess.Popen(
        as_user(user, "env", "CONCUR_RUN=999999999.1", "sleep", "600"), start_new_session=True
    )
    try:
        wait_until("the leftover runs", lambda: any("sleep 600" in p for p in user_processes(user)))
        data = write_jsonl(home / "one.jsonl", [swe_task(0) | {"replay": [tool_call("submit")]}])
        os.chown(data, user.pw_uid, user.pw_gid)
        out = home / "next"
        p = run_as(user, "--tasks", str(data), "--out", str(out), *FAST[:-1])
        assert p.returncode == 0, p.stderr[-3000:]
        assert "killed 1 processes left running by a dead run of this user" in p.stderr
        left.wait(timeout=10)
        assert not user_processes(user)
    finally:
        left.kill()
        left.wait()


@pytest.mark.slow
def test_readme_quick_start_embedded_engine_as_a_user(user: pwd.struct_passwd, home: Path) -> None:
    """README's first command (`run.py --tasks swe.jsonl`, the embedded CPU engine), cut to
    one task of two steps, as the user."""
    out = home / "swe"
    p = run_as(user, "--tasks", "swe.jsonl", "--limit", "1", "--max-steps", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = read_jsonl(out / "trajectories.jsonl")
    assert r["steps"] == 2 and r["status"] in ("max_steps", "submitted")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"]["name"] == "llama.cpp" and summary["limits"]["sandbox"] == "user"
    assert not workspace_root(out).exists() and not user_processes(user)
