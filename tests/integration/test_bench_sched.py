"""bench/sched.py: systems with their gate rules, reproducible from the CLI, and its checks."""

import json
import shlex

from bench import sched
from tests.conftest import run_cli


def test_a_system_names_its_policy_and_gate_rules():
    assert sched.parse_system("wset2") == ("wset2", ("newest", "newest"))
    assert sched.parse_system("aimd") == ("aimd", ("newest", "oldest"))  # the paper's rules
    assert sched.parse_system("wset2:reserve=0.05@longest/oldest") == (
        "wset2:reserve=0.05",
        ("longest", "oldest"),
    )
    work = sched.plan(["ds-16", "swarm"], ["wset2", "wset2@longest/newest"], [0, 1])
    assert len({run.name for run, _ in work}) == 8  # one folder per row, system and seed


def test_a_run_with_other_rules_is_reproduced_by_its_cli_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sched, "RUNS", tmp_path / "bench")
    [(run, seed)] = sched.plan(["ds-16"], ["wset2@longest/newest"], [1])
    rec = sched.execute((run, seed))
    argv = shlex.split(rec["cli"])[2:]  # after "python run.py"
    assert argv[argv.index("--pause-rule") + 1] == "longest"
    assert argv[argv.index("--workload-seed") + 1] == "1"
    run_cli(*argv, "--out", str(tmp_path / "cli"))
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["batch_seconds"] == rec["sim_seconds"]
    # the report sets it against its row's bound and finds the work of one system consistent
    text = sched.report([rec], ["wset2@longest/newest"], [1], wall=1.0)
    assert "DeepSeek-V3, 16 agents, TP16 | 1 |" in text
    assert "identical work within every row and seed; no run below its bound" in text
    # a second record of the same row and seed with other work is flagged
    other = {**rec, "system": "wset2", "work_digest": "0" * 16, "run": "other"}
    text = sched.report([rec, other], ["wset2@longest/newest", "wset2"], [1], wall=1.0)
    assert "ds-16 seed 1: 2 work digests" in text
