"""The real runner on the simulated engine, on virtual time."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.policies.registry import make_policy
from runner.sim.simulate import simulate
from runner.sim.workload import synthetic

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path, policy, name, **kw):
    w = synthetic("tiny", seed=5, gen=(30, 60))
    return simulate(w, "tiny-cpu", make_policy(policy), tmp_path / name, control_period=0.5, **kw)


def test_simulated_batch_finishes_every_agent(tmp_path):
    r = run(tmp_path, "aimd", "a")
    assert r.by_status == {"submitted": 8}
    assert r.sim_seconds > 0 and r.wall_seconds < 30
    assert 0 < r.hit_rate <= 1
    assert r.engine["requests_finished"] == sum(w[0] for w in r.work.values())
    assert (tmp_path / "a" / "control.jsonl").read_text().count("\n") >= 2
    assert (tmp_path / "a" / "trajectories.jsonl").read_text().count("\n") == 8


def test_deterministic_and_identical_work_across_policies(tmp_path):
    a1, a2 = run(tmp_path, "aimd", "a1"), run(tmp_path, "aimd", "a2")
    assert a1.sim_seconds == a2.sim_seconds and a1.engine == a2.engine
    n = run(tmp_path, "none", "n")
    c = run(tmp_path, "agent-cap:1", "c")
    assert a1.work == n.work == c.work
    # one agent at a time is slower than everyone at once on an unpressured engine
    assert c.sim_seconds > n.sim_seconds


def test_hicache_option_sizes_the_host_tier(tmp_path):
    r = run(tmp_path, "none", "h", engine_options={"hicache_ratio": 2.0})
    assert r.engine["host_capacity_tokens"] == 2 * r.engine["capacity_tokens"]
    # --hicache-size: GB per rank, over the KV bytes of one token on one GPU; wins over ratio
    from runner.sim.engine import deployment

    per_token = deployment("tiny-cpu").kv_bytes_per_token_per_gpu
    r = run(tmp_path, "none", "s", engine_options={"hicache_size": 0.01, "hicache_ratio": 2.0})
    assert r.engine["host_capacity_tokens"] == int(0.01 * 1e9 // per_token)


def test_cli_engine_sim(tmp_path):
    from tests.conftest import run_cli

    p = run_cli(
        "--engine",
        "sim",
        "--workload",
        "tiny",
        "--sim-deployment",
        "tiny-cpu",
        "--policy",
        "agent-cap:2",
        "--out",
        str(tmp_path / "o"),
    )
    assert "simulated s): {'submitted': 8}" in p.stderr
    assert (tmp_path / "o" / "trajectories.jsonl").read_text().count("\n") == 8
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    # the one summary schema of every engine, with the simulator's counters under engine.stats
    assert summary["clock"] == "virtual" and summary["engine"]["name"] == "sim"
    assert summary["agents_by_status"] == {"submitted": 8} and summary["tasks"] == 8
    assert summary["gate"]["policy"] == "agent-cap" and summary["batch_seconds"] > 0
    assert summary["engine"]["stats"]["sessions_open"] is None  # off by default
    # --sglang-sessions: the simulator's session radix cache; every session closed at the end
    run_cli(
        "--engine", "sim", "--workload", "tiny", "--sim-deployment", "tiny-cpu",
        "--sglang-sessions", "--out", str(tmp_path / "s"),
    )  # fmt: skip
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["engine"]["stats"]["sessions_open"] == 0
    bad = run_cli(
        "--engine", "sim", "--sim-deployment", "h100x1", "--out", str(tmp_path / "b"), check=False
    )
    assert bad.returncode == 2 and "unknown simulator preset" in bad.stderr


def test_long_tool_waits_under_wset_keep_every_agent_resident(tmp_path):
    # a third of the tools take 20-40 s; every context fits the pool, so wset never pauses
    # anyone for them (agents in tools keep their slot) and matches the uncontrolled engine
    w = synthetic("tiny", seed=5, slow_tools=(0.3, 20.0, 40.0))
    assert max(s.tool_seconds for a in w.agents for s in a.steps) >= 20.0
    r = simulate(w, "tiny-cpu", make_policy("wset"), tmp_path / "w", resume_rule="newest")
    none = simulate(w, "tiny-cpu", make_policy("none"), tmp_path / "n")
    assert r.gate["pauses"] == 0 and r.work == none.work
    assert r.sim_seconds == pytest.approx(none.sim_seconds, rel=0.02)


def test_host_tier_reloads_are_charged_at_its_bandwidth(tmp_path):
    # the same pressured batch with a host tier at a slow reload rate: every reloaded token
    # costs its KV bytes over the link, overlapped with the forward it comes in: what is
    # charged is the transfer less at most the prefill time it hides under
    from runner.sim.engine import deployment

    w = synthetic("tiny", seed=3, final=(3000, 6000), gen=(30, 60))
    per_token = deployment("tiny-cpu").kv_bytes_per_token_per_gpu
    for bw in (1e8, 1e7):
        opts = {"max_total_tokens": 9000, "hicache_ratio": 2.0, "pcie_bytes_per_s": bw}
        r = simulate(w, "tiny-cpu", make_policy("none"), tmp_path / f"h{bw:g}", engine_options=opts)
        e = r.engine
        transfer = e["tokens_host_load"] * per_token / bw
        assert e["tokens_host_load"] > 0
        forwards = e["seconds_prefill_new"] + e["seconds_prefill_recompute"]
        assert transfer - forwards <= e["seconds_host_load"] <= transfer
        assert e["seconds_host_load"] > 0


def test_a_simulated_batch_stopped_by_a_signal_gives_no_result(tmp_path):
    """A real SIGINT to a real simulation: the batch stops (exit code 130) and simulate()
    raises, naming it, instead of returning figures of a batch that never finished (a
    stopped bench run was once recorded with 0 simulated seconds)."""
    out = tmp_path / "run"
    code = (
        "import sys; from pathlib import Path\n"
        "from runner.policies.registry import make_policy\n"
        "from runner.sim.simulate import simulate\n"
        "from runner.sim.workload import synthetic\n"
        "simulate(synthetic('paper', seed=0), 'qwen3-32b-tp8', make_policy('none'), "
        "Path(sys.argv[1]))\n"
        "print('returned')\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    control = out / "control.jsonl"
    deadline = time.monotonic() + 120
    while not (control.exists() and control.stat().st_size) and time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)  # the batch is running: a period has been logged
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode != 0 and "returned" not in stdout
    assert "the simulated batch of paper on qwen3-32b-tp8 (none) stopped before every" in stderr
    assert "exit code 130" in stderr and str(out) in stderr
