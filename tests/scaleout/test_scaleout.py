"""One batch over many nodes on a real local Ray cluster (three raylets on 127.0.0.1), run
through run.py as a user would. The ledger's rules are also tested on their own, without Ray.

The replay tasks run real `bash` calls (`sleep`) under --sandbox none as per-agent uids: run
this module under the sandbox lock (`flock /tmp/concur-sandbox.lock python -m pytest ...`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from runner.cli.main import main
from runner.scaleout.ledger import Ledger
from runner.tasks.tasks import Task

REPO = Path(__file__).resolve().parents[2]
# Ray would otherwise rewrite 127.0.0.1 to this machine's outward address (see
# docs/scale-out.md): every node, worker and driver here binds and connects on loopback.
# Ray reads it when first imported: set before any test of this module imports it.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK)


# ---- the ledger, on its own -----------------------------------------------------------------


def _tasks(n: int) -> list[Task]:
    return [Task(f"t{i}", [{"role": "user", "content": "x"}]) for i in range(n)]


def test_ledger_puts_a_lost_workers_tasks_back_in_task_order_and_keeps_the_first_record():
    led = Ledger(_tasks(6), session="s")
    a = led.take(0, 3)
    b = led.take(1, 2)
    assert [x.task.id for x in a] == ["t0", "t1", "t2"]
    assert [x.attempt for x in a + b] == ["s.1", "s.2", "s.3", "s.4", "s.5"]
    led.commit("t1")  # worker 0 finished t1
    assert led.lost(0) == ["t0", "t2"]
    assert [t.id for t in led.queue] == ["t0", "t2", "t5"]
    again = led.take(1, 1)
    assert again[0].task.id == "t0" and again[0].attempt == "s.6"  # a new attempt id
    led.commit("t0")
    assert not led.is_first("t0")  # a late record of the lost attempt is discarded
    assert led.is_first("t3") and not led.is_first("unknown")


def test_ledger_is_done_only_when_nothing_is_queued_or_running():
    led = Ledger(_tasks(2))
    x = led.take(0, 5)
    assert len(x) == 2 and not led.all_done
    led.commit("t0")
    assert not led.all_done and led.running_on(0) == 1
    led.commit("t1")
    assert led.all_done and led.unfinished == []


def test_ledger_share_splits_the_queue():
    led = Ledger(_tasks(7))
    assert led.share(2) == 4 and led.share(0) == 7


# ---- errors that need no cluster ----------------------------------------------------------


def test_ray_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what Python does when it is not installed
    tasks = _write_tasks(tmp_path / "t.jsonl", 2, sleeps=0)
    rc = main(["--tasks", str(tasks), "--engine", "replay", "--ray", "--out", str(tmp_path / "o")])
    err = capsys.readouterr()
    assert rc == 2
    assert "pip install 'concur-runner[ray]'" in err.err


def test_an_unreachable_cluster_is_a_clear_error(tmp_path, capsys):
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tasks = _write_tasks(tmp_path / "t.jsonl", 2, sleeps=0)
    t0 = time.monotonic()
    args = ["--tasks", str(tasks), "--engine", "replay", "--out", str(tmp_path / "o")]
    rc = main([*args, "--ray", f"127.0.0.1:{port}"])
    out = capsys.readouterr()
    assert rc == 2 and time.monotonic() - t0 < 30
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port}" in out.err
    assert "ray start --head" in out.err


def test_a_cluster_address_is_probed_once(tmp_path, monkeypatch):
    # the cluster recorded by `ray start` (probed to choose it) and one given with --ray:
    # each is connected to once before Ray joins it (the recorded one was probed twice, up
    # to 2 s more at start)
    from runner.scaleout.driver import reach

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(0.5)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text(address + "\n")
        monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        for given in (None, address):
            assert reach(given).address == address
            probes = 0
            with contextlib.suppress(TimeoutError):
                while True:
                    server.accept()[0].close()
                    probes += 1
            assert probes == 1, given


def test_workers_without_ray_is_refused(tmp_path, capsys):
    tasks = _write_tasks(tmp_path / "t.jsonl", 1, sleeps=0)
    assert main(["--tasks", str(tasks), "--workers", "2", "--out", str(tmp_path / "o")]) == 2
    assert "--workers needs --ray" in capsys.readouterr().err


def test_the_recorded_cluster_file_is_where_ray_keeps_it(monkeypatch, tmp_path):
    from ray._common.utils import get_ray_address_file

    from runner.scaleout.driver import recorded_address_file

    for env in ({"RAY_TMPDIR": str(tmp_path)}, {"TMPDIR": str(tmp_path / "t")}, {}):
        for key in ("RAY_TMPDIR", "TMPDIR"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert recorded_address_file() == Path(get_ray_address_file(None))


# ---- a real multi-node cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """Three raylets on loopback, one CPU each (a worker needs one: one worker per node)."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # imported before LOOPBACK was set, Ray would start its nodes on the outward address
    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before LOOPBACK was set"

    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"}
    )
    try:
        for _ in range(2):
            c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        ray.init(address=c.address, _node_ip_address="127.0.0.1")
        c.wait_for_nodes()
        ray.shutdown()  # the test process needs no connection: run.py is the driver
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _write_tasks(path: Path, n: int, sleeps: int = 2, seconds: float = 0.3) -> Path:
    call = json.dumps({"name": "bash", "arguments": {"command": f"sleep {seconds}"}})
    with path.open("w") as f:
        for i in range(n):
            rec = {
                "id": f"t{i:03d}",
                "prompt": "wait, then submit",
                "tools": ["bash", "submit"],
                "replay": [f"<tool_call>{call}</tool_call>"] * sleeps,
            }
            f.write(json.dumps(rec) + "\n")
    return path


def _run_py(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), *args, "--progress-interval", "1"]


def _records(out: Path) -> list[dict]:
    path = out / "trajectories.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _env() -> dict[str, str]:
    return {**os.environ, **LOOPBACK}


def _replay(tasks: Path, out: Path, *extra: str) -> list[str]:
    return _run_py("--tasks", str(tasks), "--engine", "replay", "--sandbox", "none",
                   "--out", str(out), *extra)  # fmt: skip


def test_every_task_once_and_the_same_set_as_one_process(cluster, tmp_path):
    tasks = _write_tasks(tmp_path / "tasks.jsonl", 18)
    single = subprocess.run(_replay(tasks, tmp_path / "single"), env=_env(), timeout=120)
    assert single.returncode == 0
    r = subprocess.run(
        _replay(tasks, tmp_path / "ray", "--ray", cluster.address), env=_env(), timeout=180
    )
    assert r.returncode == 0
    ids = Counter(rec["task_id"] for rec in _records(tmp_path / "ray"))
    assert set(ids) == {rec["task_id"] for rec in _records(tmp_path / "single")}
    assert set(ids.values()) == {1}
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    workers = summary["workers"]
    assert len(workers) == 3 and len({w["node_id"] for w in workers}) == 3  # one per node
    assert sum(w["records_kept"] for w in workers) == 18
    assert all(w["records_kept"] > 0 for w in workers)  # the work was shared
    assert summary["agents_by_status"] == {"submitted": 18}
    assert summary["scaleout"]["workers_lost"] == 0
    assert all(rec["attempt"] and rec["worker"] in (0, 1, 2) for rec in _records(tmp_path / "ray"))
    # which limits bound the agents, as in a single process's summary
    one = json.loads((tmp_path / "single" / "summary.json").read_text())
    ray_limits, one_limits = summary["limits"], one["limits"]
    assert ray_limits.pop("cgroup")["kind"] == one_limits.pop("cgroup")["kind"]  # where: per pid
    assert ray_limits == one_limits and ray_limits["sandbox"] == one["sandbox"]
    lines = [json.loads(x) for x in (tmp_path / "ray" / "control.jsonl").read_text().splitlines()]
    assert {x["worker"] for x in lines} == {0, 1, 2}


def _wait_records(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while len(_records(out)) < n:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() - t0 < timeout
        time.sleep(0.1)


def test_killing_a_worker_mid_batch_loses_and_duplicates_nothing(cluster, tmp_path):
    tasks = _write_tasks(tmp_path / "tasks.jsonl", 36, sleeps=3, seconds=0.4)
    out = tmp_path / "ray"
    proc = subprocess.Popen(_replay(tasks, out, "--ray", cluster.address), env=_env())
    try:
        _wait_records(out, 4, proc)
        log = (out / "run.log").read_text()
        pid = int(re.search(r"worker 1: pid (\d+)", log).group(1))
        os.kill(pid, signal.SIGKILL)  # the worker's own process, as a crash would
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    ids = Counter(rec["task_id"] for rec in _records(out))
    assert len(ids) == 36 and set(ids.values()) == {1}
    summary = json.loads((out / "summary.json").read_text())
    lost = summary["workers"][1]
    assert lost["lost"] and lost["tasks_put_back"]  # it had agents in flight
    assert summary["scaleout"]["workers_lost"] == 1
    assert summary["scaleout"]["tasks_put_back"] == len(lost["tasks_put_back"])
    by_worker = {rec["task_id"]: rec["worker"] for rec in _records(out)}
    assert all(by_worker[t] != 1 for t in lost["tasks_put_back"])  # run elsewhere
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["worker"] for e in errors if e["kind"] == "worker_lost"] == [1]


def test_sigkill_of_the_driver_then_a_rerun_runs_only_the_unfinished(cluster, tmp_path):
    tasks = _write_tasks(tmp_path / "tasks.jsonl", 30, sleeps=3, seconds=0.4)
    out = tmp_path / "ray"
    cmd = _replay(tasks, out, "--ray", cluster.address, "--workers", "2")
    proc = subprocess.Popen(cmd, env=_env())
    try:
        _wait_records(out, 5, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = {rec["task_id"]: rec["attempt"] for rec in _records(out)}
    assert 5 <= len(first) < 30
    again = subprocess.run(cmd, env=_env(), timeout=180, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(first)} already finished" in again.stderr
    recs = _records(out)
    ids = Counter(rec["task_id"] for rec in recs)
    assert len(ids) == 30 and set(ids.values()) == {1}
    for rec in recs:  # the first run's records are kept as they were
        if rec["task_id"] in first:
            assert rec["attempt"] == first[rec["task_id"]]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["this_session"]["agents_run"] == 30 - len(first)
    assert summary["unfinished"] == 0


def test_sim_workers_each_log_their_own_control_timeline(cluster, tmp_path):
    out = tmp_path / "sim"
    cmd = _run_py("--engine", "sim", "--workload", "tiny", "--sim-deployment", "tiny-cpu")
    # periods of 0.1 simulated s: a worker's share of the tiny batch spans several of them
    # (under the default wset2, which admits a worker's agents at once, a 2-s period can
    # outlast a worker's whole share)
    cmd += ["--control-period", "0.1", "--ray", cluster.address, "--workers", "2"]
    cmd += ["--out", str(out)]
    assert subprocess.run(cmd, env=_env(), timeout=180).returncode == 0
    lines = [json.loads(x) for x in (out / "control.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clock"] == "virtual" and summary["unfinished"] == 0
    for w in (0, 1):
        mine = [x for x in lines if x["worker"] == w]
        assert len(mine) >= 2
        times = [x["t"] for x in mine]
        assert times == sorted(times) and times[0] == 0.0  # its own clock, from its start
        assert any(x["admitted"] for x in mine)  # it ran agents of its own
    admitted = [a for x in lines for a in x["admitted"]]
    assert len(admitted) == len(set(admitted)) == summary["tasks"]


def test_removing_a_whole_node_mid_batch_loses_and_duplicates_nothing(cluster, tmp_path):
    """A fourth node joins; one worker runs on each; that node is removed (its raylet and
    every process on it) while its worker has agents in flight."""
    node = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    removed = False
    try:
        cluster.wait_for_nodes()
        tasks = _write_tasks(tmp_path / "tasks.jsonl", 40, sleeps=3, seconds=0.4)
        out = tmp_path / "ray"
        proc = subprocess.Popen(_replay(tasks, out, "--ray", cluster.address), env=_env())
        try:
            _wait_records(out, 4, proc)
            log = (out / "run.log").read_text()
            assert "4 workers over 4 nodes" in log
            on_node = re.search(rf"worker (\d+): pid \d+ on \S+ \(node {node.node_id[:12]}\)", log)
            k = int(on_node.group(1))
            cluster.remove_node(node)
            removed = True
            assert proc.wait(timeout=180) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        if not removed:
            cluster.remove_node(node)
    ids = Counter(rec["task_id"] for rec in _records(out))
    assert len(ids) == 40 and set(ids.values()) == {1}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agents_by_status"] == {"submitted": 40}
    lost = summary["workers"][k]
    assert lost["lost"] and lost["tasks_put_back"]
    assert summary["scaleout"]["workers_lost"] == 1
    by_worker = {rec["task_id"]: rec["worker"] for rec in _records(out)}
    assert all(by_worker[t] != k for t in lost["tasks_put_back"])  # run on the other nodes
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["worker"] for e in errors if e["kind"] == "worker_lost"] == [k]


def test_ray_without_an_address_starts_a_local_cluster_on_loopback(tmp_path):
    """`--ray` alone, no $RAY_ADDRESS, and the cluster file names a stopped cluster: a local
    cluster on 127.0.0.1 runs the batch (the loopback setting not given: run.py sets it), and
    is gone when the run ends."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths
    try:
        with socket.socket() as sock:  # a loopback port nobody listens on
            sock.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sock.getsockname()[1]}"
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
        env = {k: v for k, v in os.environ.items() if k not in (*LOOPBACK, "RAY_ADDRESS")}
        env["RAY_TMPDIR"] = str(ray_tmp)
        tasks = _write_tasks(tmp_path / "tasks.jsonl", 4, sleeps=1, seconds=0.1)
        out = tmp_path / "ray"
        cmd = _replay(tasks, out, "--ray", "--workers", "2")
        r = subprocess.run(cmd, env=env, timeout=180, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"names the Ray cluster {dead}, which does not answer" in r.stderr
        assert "Ray: a local Ray cluster on 127.0.0.1" in r.stderr
        assert "2 workers over 1 nodes at 127.0.0.1 " in r.stderr
        ids = Counter(rec["task_id"] for rec in _records(out))
        assert len(ids) == 4 and set(ids.values()) == {1}
        figures = json.loads((out / "summary.json").read_text())["scaleout"]
        assert figures["ray_address"] == "local"
        deadline = time.monotonic() + 30  # the driver's ray.shutdown() stops what it started
        while _ray_processes(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ray_processes(ray_tmp) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _ray_processes(ray_tmp: Path) -> list[str]:
    """Processes whose command line names this Ray temp dir (pgrep only looks)."""
    p = subprocess.run(["pgrep", "-f", str(ray_tmp)], capture_output=True, text=True)
    return p.stdout.split()
