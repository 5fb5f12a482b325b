"""End to end: the real CLI, the real SmolLM2 engine, the real bubblewrap sandbox."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from runner.cli.main import workspace_root
from tests.conftest import ROOT, read_jsonl, run_cli, small_tasks

pytestmark = pytest.mark.slow
FAST = ["--max-new-tokens", "40", "--n-ctx", "4096", "--control-period", "0.5"]


def test_batch_runs_and_writes_everything(tmp_path, needs_bwrap):
    tasks = small_tasks(tmp_path / "t.jsonl", 3, max_steps=2)
    with tasks.open("a") as f:
        f.write("{not json\n")
        f.write(json.dumps({"id": "swe-001-pagination-off-by-one", "prompt": "dup"}) + "\n")
    out = tmp_path / "out"
    p = run_cli("--tasks", str(tasks), "--out", str(out), "--keep-workspaces", *FAST)
    assert "skipping task record" in p.stderr
    trajs = read_jsonl(out / "trajectories.jsonl")
    assert sorted(t["task_id"] for t in trajs) == sorted(
        json.loads(line)["id"] for line in tasks.read_text().splitlines()[:3]
    )
    for t in trajs:
        assert t["status"] in ("submitted", "max_steps", "context_limit")
        assert 1 <= t["steps"] <= 2 and len(t["step_log"]) == t["steps"]
        assert t["messages"][0]["role"] == "system" and t["messages"][1]["role"] == "user"
        s = t["step_log"][0]
        assert s["prompt_tokens"] > 100 and s["completion_tokens"] > 0 and s["gen_seconds"] > 0
        # constrained decoding (auto on llama.cpp): the real model's replies are real calls
        assert s["tool"] in {"bash", "python", "str_replace_editor", "submit"}, s
        # the buggy project is untouched or not fixed by a 135M model: the eval ran for real
        assert t["eval"]["command"].startswith("python3 -m pytest")
        assert t["eval"]["exit_code"] is not None
        assert (out / "workspaces" / t["task_id"] / "tests").is_dir()
    errors = read_jsonl(out / "errors.jsonl")
    reasons = " | ".join(e["reason"] for e in errors)
    assert "invalid JSON" in reasons and "duplicate id" in reasons
    assert {e["line"] for e in errors} == {4, 5}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == 3 and summary["invalid_records"] == 2
    assert summary["engine"]["name"] == "llama.cpp" and summary["sandbox"] == "bwrap"
    assert summary["prompt_tokens"] >= summary["cached_tokens"] > 0
    g = summary["gate"]
    assert g["policy"] == "wset2" and g["policy_params"]["reserve"] == 0.1  # the default
    assert g["window"]["min"] >= 1 and (g["pause_rule"], g["resume_rule"]) == ("newest", "newest")
    control = read_jsonl(out / "control.jsonl")
    assert control and {
        "w_before",
        "w_after",
        "u",
        "h",
        "branch",
        "active",
        "paused",
        "pending",
        "finished",
        "admitted",
        "paused_ids",
        "resumed",
    } <= set(control[0])
    assert sorted(a for c in control for a in c["admitted"]) == sorted(t["task_id"] for t in trajs)
    # same command again: everything is finished, nothing runs twice
    run_cli("--tasks", str(tasks), "--out", str(out), *FAST)
    assert len(read_jsonl(out / "trajectories.jsonl")) == 3


@pytest.mark.parametrize("policy", ["none", "agent-cap:1", "request-cap:1"])
def test_each_baseline_policy_runs(tmp_path, needs_bwrap, policy):
    tasks = small_tasks(tmp_path / "t.jsonl", 2, max_steps=2)
    out = tmp_path / "out"
    run_cli("--tasks", str(tasks), "--out", str(out), "--policy", policy, *FAST)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == 2
    assert summary["gate"]["policy"] == policy.split(":")[0]
    if policy != "none":
        assert summary["gate"]["window"]["max"] == 1


def test_bad_gate_values_are_rejected(tmp_path):
    for args, msg in (
        (["--policy", "lru"], "unknown policy"),
        (["--beta", "1.5"], "--beta"),
        (["--u-low", "0.6"], "--u-low"),
    ):
        p = run_cli("--tasks", "swe.jsonl", "--out", str(tmp_path), *args, check=False)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_sigkill_then_resume_finishes_each_task_once(tmp_path, needs_bwrap):
    tasks = small_tasks(tmp_path / "t.jsonl", 6, max_steps=3)
    out = tmp_path / "out"
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        "--tasks",
        str(tasks),
        "--out",
        str(out),
        "--policy",
        "agent-cap:2",
        *FAST,
    ]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    traj = out / "trajectories.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if traj.exists() and traj.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the batch ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = traj.read_text().count("\n")
    assert 2 <= first < 6
    # simulate the worst case of a kill during a write: a torn last line
    with traj.open("a") as f:
        f.write('{"task_id": "swe-00')
    # resumed with its own options (other result-changing options are refused)
    p = run_cli("--tasks", str(tasks), "--out", str(out), "--policy", "agent-cap:2", *FAST)
    assert "torn" in p.stderr
    lines = traj.read_text().splitlines()
    ids = [json.loads(line)["task_id"] for line in lines]  # every line parses
    assert sorted(ids) == sorted(json.loads(t)["id"] for t in tasks.read_text().splitlines())
    assert len(ids) == len(set(ids)) == 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == 6 and summary["this_session"]["agents_run"] == 6 - first
    assert not workspace_root(out).exists()  # the killed run's workspaces were cleared
