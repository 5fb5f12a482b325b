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
