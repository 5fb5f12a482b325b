"""Hostile tool calls inside a real batch: `python run.py --engine replay` with the real
bubblewrap sandbox. Each attack is one agent's scripted tool call; it must be contained
with an observation that says what happened, while the other agents of the same batch
finish normally and their evals score right. Also: 200 concurrent sandboxed calls, and
`--eval-only` / `--replay-from` over a finished run."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.conftest import SWE, read_jsonl, run_cli, write_jsonl
from tools.core import ToolContext
from tools.registry import get_tools
from tools.sandbox import AGENT_UID_BASE, BwrapSandbox, Limits

# Every call but the fork bomb and the CPU loop (killed at it) must end within the tool
# timeout, 15 agents at once, git setup and submit included. 3 s was too tight on a loaded
# 2-core machine: the disk fill (then on disk, watched) took 3.15 s to reach 256 MiB beside 8
# busy loops.
TOOL_TIMEOUT = 10
FAST = ["--engine", "replay", "--policy", "none", "--n-ctx", "1000000", "--control-period", "0.5"]
HOST_MARKERS = ("/etc/pwned-by-agent", "/usr/pwned-by-agent", "/pwned-by-agent")


def tool_call(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def bash(cmd: str) -> str:
    return tool_call("bash", command=cmd)


def python(code: str) -> str:
    return tool_call("python", code=code)


def swe_task(n: int) -> dict:
    return json.loads(SWE.read_text().splitlines()[n])


def solved_and_unsolved() -> list[dict]:
    """swe task 0 fixed by the editor with its reference fix; swe task 1 left as it is."""
    fixed, unsolved = swe_task(0), swe_task(1)
    fix, fix1 = fixed["metadata"]["reference_fix"], unsolved["metadata"]["reference_fix"]
    fixed["replay"] = [
        tool_call("str_replace_editor", command="view", path="/work"),
        tool_call(
            "str_replace_editor",
            command="str_replace",
            path=f"/work/{fix['path']}",
            old_str=fix["old"],
            new_str=fix["new"],
        ),
        bash("python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -1 | cut -d' ' -f1,2"),
        tool_call("submit", answer="fixed"),
    ]
    unsolved["replay"] = [
        tool_call("str_replace_editor", command="view", path=fix1["path"]),
        tool_call("submit", answer="gave up"),
    ]
    return [fixed, unsolved]


class Listener:
    """A TCP server on the host's 127.0.0.1 that counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def attack_tasks(port: int, host_secret: Path) -> list[dict]:
    def t(tid: str, *replay: str) -> dict:
        return {"id": tid, "prompt": f"attack: {tid}", "replay": [*replay]}

    writes = "; ".join(f"echo x > {m}" for m in (*HOST_MARKERS, host_secret.parent / "pwned"))
    return [
        t(
            "write-outside",
            bash(f"{writes}; echo done"),
            python("open('/etc/pwned-by-agent', 'w').write('x')"),
            tool_call(
                "str_replace_editor", command="create", path="/etc/pwned-by-agent", file_text="x"
            ),
        ),
        t(
            "read-secrets",
            bash(f"cat /etc/shadow; ls -la /root; cat {host_secret}; echo rc=$?"),
            tool_call("str_replace_editor", command="view", path="/etc/shadow"),
        ),
        t(
            "network",
            python(
                "import socket\n"
                "for host in ('127.0.0.1', 'localhost', '10.0.2.2', '1.1.1.1'):\n"
                "    try:\n"
                f"        socket.create_connection((host, {port}), timeout=2)\n"
                "        print(host, 'CONNECTED')\n"
                "    except OSError as e:\n"
                "        print(host, 'blocked:', e)\n"
            ),
            bash(f"echo hi > /dev/tcp/127.0.0.1/{port} && echo CONNECTED"),
        ),
        t(
            "mount",
            bash(
                "mount -o remount,rw / ; mount -t tmpfs none /usr ; mount --bind /work /etc ; "
                "unshare -m -r true ; touch /usr/pwned-by-agent ; echo survived"
            ),
        ),
        t("fork-bomb", bash(":(){ :|:& };:; sleep 10")),
        t(
            "fork-count",
            python(
                "import os, time\nn = 0\ntry:\n    while n < 10000:\n        if os.fork() == 0:\n"
                "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
                "except OSError as e:\n    print('forks', n, 'then', e.strerror)\n"
            ),
        ),
        t("memory", python("x = bytearray(4 << 30)\nprint('ALLOCATED')")),
        t("cpu-loop", python("while True:\n    pass")),
        t(
            "output-flood",
            tool_call(
                "bash",
                command="yes AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA | head -c 1000000000",
                timeout=60,  # not killed at the tool timeout: it must end by itself
            ),
        ),
        t(
            "disk-fill",
            python(
                "i = 0\nwhile True:\n    open(f'fill{i}', 'wb').write(b'x' * (1 << 20))\n    i += 1"
            ),
            bash("rm -f fill*; echo cleaned"),
        ),
        t(
            "escapee",
            bash(
                "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & "
                "nohup sleep 1001 >/dev/null 2>&1 & (setsid sleep 1002 &); echo started"
            ),
            bash("sleep 1; echo later"),
        ),
    ]


def obs(rec: dict) -> list[str]:
    return [s["observation"] for s in rec["step_log"]]


def test_attacks_contained_in_a_batch(tmp_path: Path, needs_bwrap) -> None:
    for m in HOST_MARKERS:
        assert not os.path.exists(m)
    host_secret = tmp_path / "host-secret.txt"
    host_secret.write_text("HOST SECRET\n")
    host_secret.chmod(0o644)  # world-readable on the host: still invisible in the sandbox
    server = Listener()
    try:
        tasks = [*solved_and_unsolved(), *attack_tasks(server.port, host_secret)]
        tasks.append({"id": "bystander", "prompt": "p", "replay": [python("print(6 * 7)")]})
        path = tmp_path / "attacks.jsonl"
        write_jsonl(path, tasks)
        out = tmp_path / "out"
        t0 = time.monotonic()
        run_cli(
            "--tasks",
            str(path),
            "--out",
            str(out),
            "--tool-timeout",
            str(TOOL_TIMEOUT),
            *FAST,
            timeout=120,
        )
        wall = time.monotonic() - t0
    finally:
        server.close()
    recs = {r["task_id"]: r for r in read_jsonl(out / "trajectories.jsonl")}
    assert set(recs) == {t["id"] for t in tasks}
    assert all(r["status"] == "submitted" for r in recs.values()), {
        k: (r["status"], r["reason"]) for k, r in recs.items()
    }
    assert wall < 60

    # the other agents finished normally, and their evals scored right
    fixed, unsolved = recs["swe-001-pagination-off-by-one"], recs["swe-002-mutable-default-tags"]
    assert fixed["eval"]["solved"] and fixed["eval"]["exit_code"] == 0
    assert obs(fixed)[2] == "4 passed\n[exit code 0]"
    assert "+    start = (page - 1) * per_page" in fixed["patch"]["diff"]
    assert not unsolved["eval"]["solved"] and unsolved["eval"]["exit_code"] == 1
    assert "failed" in unsolved["eval"]["output_tail"] and unsolved["patch"]["files"] == 0
    assert obs(recs["bystander"])[0] == "42\n[exit code 0]"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["solved"], summary["evaluated"]) == (1, 2)
    assert summary["engine"]["name"] == "replay" and summary["sandbox"] == "bwrap"
    limits = summary["limits"]  # root mode: per agent, memory where a cgroup is ours
    assert (limits["sandbox"], limits["processes"]["per"]) == ("root", "agent")
    assert limits["memory"]["per"] == ("process" if limits["cgroup"]["kind"] == "none" else "agent")

    o = obs(recs["write-outside"])
    assert o[0].count("Read-only file system") + o[0].count("No such file") >= 4
    assert "Read-only file system" in o[1] and "outside the workspace" in o[2]
    for m in HOST_MARKERS:
        assert not os.path.exists(m)
    assert not (tmp_path / "pwned").exists()

    o = obs(recs["read-secrets"])
    assert "/etc/shadow: No such file" in o[0] and "'/root': No such file" in o[0]
    assert "HOST SECRET" not in o[0] and "root:" not in o[0]
    assert "outside the workspace" in o[1]

    o = obs(recs["network"])
    assert "CONNECTED" not in o[0] and "CONNECTED" not in o[1]
    assert o[0].count("blocked:") == 4 and "[exit code 1]" in o[1]
    assert server.accepted == 0

    o = obs(recs["mount"])[0]
    assert "survived" in o and ("permission denied" in o or "must be superuser" in o)
    assert "touch: cannot touch '/usr/pwned-by-agent': Read-only file system" in o

    o = obs(recs["fork-bomb"])[0]
    assert f"timed out after {TOOL_TIMEOUT}s" in o and "Resource temporarily unavailable" in o
    o = obs(recs["fork-count"])[0]
    n = int(o.split("forks ")[1].split()[0])
    assert n < 64 and "Resource temporarily unavailable" in o  # RLIMIT_NPROC

    o = obs(recs["memory"])[0]
    assert "MemoryError" in o and "ALLOCATED" not in o

    o = obs(recs["cpu-loop"])[0]
    assert o.endswith(f"[killed: timed out after {TOOL_TIMEOUT}s]")
    step = recs["cpu-loop"]["step_log"][0]
    assert TOOL_TIMEOUT <= step["tool_seconds"] < TOOL_TIMEOUT + 3

    o = obs(recs["output-flood"])[0]
    assert "more bytes not shown" in o and "characters truncated" in o
    assert o.endswith("[exit code 0]")  # drained past the cap: the writer finished
    assert recs["output-flood"]["step_log"][0]["tool_seconds"] < 30

    o = obs(recs["disk-fill"])  # the workspace is its own 256 MiB tmpfs: ENOSPC at the limit
    assert "OSError: [Errno 28] No space left on device" in o[0]
    assert "[workspace full: 256.0 MiB used of its 256.0 MiB limit (its own tmpfs" in o[0]
    assert "cleaned" in o[1] and "workspace full" not in o[1]

    o = obs(recs["escapee"])
    assert o[0] == "started\n[exit code 0]" and "later" in o[1]

    # nothing of any agent outlived the batch, the setsid escapees included
    uids = ",".join(str(AGENT_UID_BASE + i) for i in range(len(tasks)))
    left = subprocess.run(["pgrep", "-a", "-u", uids], capture_output=True, text=True).stdout
    assert left == ""
    assert subprocess.run(["pgrep", "-f", "sleep 100[012]"], capture_output=True).returncode == 1

    # no kept workspaces: --eval-only refuses with a clear message
    p = run_cli("--tasks", str(path), "--out", str(out), "--eval-only", check=False)
    assert p.returncode == 2 and "--keep-workspaces" in p.stderr


def test_eval_only_and_replay_from(tmp_path: Path, needs_bwrap) -> None:
    tasks = solved_and_unsolved()
    path = tmp_path / "t.jsonl"
    write_jsonl(path, tasks)
    out = tmp_path / "out"
    run_cli("--tasks", str(path), "--out", str(out), "--keep-workspaces", *FAST, timeout=120)
    first = {r["task_id"]: r for r in read_jsonl(out / "trajectories.jsonl")}
    assert [first[t["id"]]["eval"]["solved"] for t in tasks] == [True, False]
    # fix the unsolved task's kept workspace by hand, then score the run again
    fix = tasks[1]["metadata"]["reference_fix"]
    ws = out / "workspaces" / tasks[1]["id"]
    src = ws / fix["path"]
    src.write_text(src.read_text().replace(fix["old"], fix["new"]))
    p = run_cli("--tasks", str(path), "--out", str(out), "--eval-only")
    assert "solved 2/2" in p.stderr
    again = read_jsonl(out / "trajectories.jsonl")
    assert len(again) == 2 and all(
        r["eval"]["solved"] and r["rescored_at"] is not None for r in again
    )
    assert [r["step_log"] for r in again] == [first[r["task_id"]]["step_log"] for r in again]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["solved"], summary["evaluated"]) == (2, 2)
    assert summary["eval_only"]["rescored"] == 2
    assert not list(out.glob("*.tmp"))

    # --replay-from: the same turns again, from the first run's trajectories: same results
    for t in tasks:
        del t["replay"]
    write_jsonl(path, tasks)
    out2 = tmp_path / "out2"
    run_cli("--tasks", str(path), "--out", str(out2), "--replay-from", str(out), *FAST)
    second = {r["task_id"]: r for r in read_jsonl(out2 / "trajectories.jsonl")}
    for tid, r in second.items():
        keys = ("tool", "arguments", "observation", "prompt_tokens", "completion_tokens")
        assert [{k: s[k] for k in keys} for s in r["step_log"]] == [
            {k: s[k] for k in keys} for s in first[tid]["step_log"]
        ]
        assert r["eval"]["solved"] == first[tid]["eval"]["solved"]


async def test_200_concurrent_sandboxed_calls(needs_bwrap) -> None:
    base = Path(tempfile.mkdtemp(prefix="concurrent-", dir="/tmp"))
    base.chmod(0o711)
    sb = BwrapSandbox()
    try:
        ctxs = []
        for i in range(200):
            uid = 230000 + i
            sb.prepare_workspace(base / str(uid), uid)
            ctxs.append(ToolContext(base / str(uid), uid, sb, Limits(timeout_s=60)))
        tools = get_tools(["bash", "python"])

        async def main() -> list:
            calls = []
            for i, c in enumerate(ctxs):
                if i % 2:
                    calls.append(tools["bash"]({"command": "echo ok $(id -u)"}, c))
                else:
                    calls.append(
                        tools["python"]({"code": "import os; print('ok', os.getuid())"}, c)
                    )
            try:
                return await asyncio.gather(*calls)
            finally:
                await sb.aclose()

        results = await main()
        for c, o in zip(ctxs, results, strict=True):
            assert o.ok and o.text == f"ok {c.uid}\n[exit code 0]", o.text
    finally:
        shutil.rmtree(base, ignore_errors=True)
