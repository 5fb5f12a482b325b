"""The sim CLI reproduces bench runs exactly: the same seconds from `run.py` with the
arguments the bench records for a run (its `cli` field) as from the bench's own function."""

import importlib.util
import json
import shlex
import sys

import pytest

from .conftest import ROOT, run_cli


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "name",
    # the capped DeepSeek pool, and a host tier with its size and reload rate set
    ["ds-32-aimd", "ds-32-hicache-host200-bw2"],
)
def test_cli_reproduces_paper_bench_run(tmp_path, monkeypatch, name):
    paper = _bench("paper")
    monkeypatch.setattr(paper, "RUNS", tmp_path / "bench")
    run = next(r for r in paper.plan("ds-32", quick=False) if r.name == name)
    rec = paper.execute((run, 0))
    argv = shlex.split(rec["cli"])[2:]  # after "python run.py"
    run_cli(*argv, "--out", str(tmp_path / "cli"))
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["batch_seconds"] == rec["sim_seconds"]
    assert summary["agents_by_status"] == {"submitted": 32}


def test_bounds_report_flags_a_run_faster_than_its_bound():
    # bench/bounds.py recomputes every row's bound without rerunning: a recorded run faster
    # than its row's bound is named (and makes the script exit 1); the others are not
    bounds = _bench("bounds")
    recs = [
        {"run": "qwen-tp8-wset", "config": "qwen-tp8", "system": "wset", "sim_seconds": 539.0},
        {"run": "qwen-tp8-fast", "config": "qwen-tp8", "system": "aimd", "sim_seconds": 100.0},
    ]
    text, faster = bounds.report(recs)
    assert faster == ["qwen-tp8-fast"]
    b = bounds.lower_bound(bounds.synthetic("paper", seed=0), "qwen3-32b-tp8")["bound_seconds"]
    assert f"| Qwen3-32B, 256 agents, TP8 | {b:,.0f} |" in text
    assert f"| 539 | {539 / b:.2f} |" in text  # wset against it
