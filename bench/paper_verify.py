"""Rerun some runs of bench.paper and bench.stress; compare them with the committed
paper.json and stress.json (bench/results/paper/, bench/results/stress/).

    python -m bench.paper_verify RUN [RUN ...] [--jobs 2]
    python -m bench.paper_verify --preset gate       # the subset that exercises the gate
    python -m bench.paper_verify --preset wset2      # wset2's runs, those that drop KV first
    python -m bench.paper_verify --cli --preset cli  # each kind of run, through run.py

For a change that must not move any decision (the gate's data structures, a refactor): every
run must give the same simulated seconds, work digest, hit rate, engine counters and gate
summary (pauses, resumes, window, branches, seconds paused) as its record in
bench/results/paper/paper.json or stress/stress.json. Writes nothing there (the runs' folders
go to outputs/bench-stress/); exits 1 on any difference, naming it.

With --cli, each run is its record's `cli` line instead (`python run.py --engine sim ...`, in
a subprocess, into a temporary folder): the simulated seconds (summary.json's batch_seconds)
and the agents' statuses must be the record's (issue 16: the CLI reproduces every bench run).
The `cli` preset is one run of every kind: every system, every row of both scripts, every
sweep (policy parameters, AIMD thresholds, host-tier variants, fixed caps).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import stress_runs
from bench.common.paper_runs import execute, plan
from bench.common.paths import PAPER_RESULTS, ROOT, STRESS_RESULTS, STRESS_RUNS

# Every Table 1 row under aimd, wset and wset+hicache (DeepSeek: every system, they are
# cheap), the request unit, the runs with the most pauses and resumes (both resume rules),
# and the stress rows where the gate works hardest (2,048 agents; minute-long tools).
PRESETS = {
    "gate": [
        *(f"{c}-{s}" for c in ("ds-16", "ds-32", "ds-40") for s in
          ("none", "request-cap", "hicache", "aimd", "wset", "wset+hicache")),
        "qwen-tp8-aimd", "qwen-tp8-wset", "qwen-tp8-request-cap", "qwen-tp8-wset-target1.8",
        "qwen-tp4-wset", "qwen-tp4-wset+hicache",
        "qwen-tp2-aimd", "qwen-tp2-wset", "qwen-tp2-ulow0.5",
        "stress-swarm-wset", "stress-swarm-aimd", "stress-slow-tools-wset",
        "stress-ds-spikes-wset",
    ],
    # the two that drop KV of holders in long tools (slow-tools, with and without the host
    # tier), then rows where nothing is dropped and the fit alone decides (a sweep point that
    # cuts on recompute among them)
    "wset2": [
        "stress-slow-tools-wset2", "stress-slow-tools-wset2-hicache",
        "ds-16-wset2", "ds-32-wset2", "ds-40-wset2+hicache", "stress-ds-spikes-wset2",
        "qwen-tp8-wset2", "qwen-tp4-wset2-beta0.25", "stress-swarm-wset2",
    ],
    # one run of every kind, the cheapest: every system (on DeepSeek-32), every row of
    # paper.py and stress.py, every sweep
    "cli": [
        *(f"ds-32-{s}" for s in ("none", "request-cap", "hicache", "aimd", "wset",
                                  "wset+hicache", "wset2", "wset2+hicache")),
        "ds-16-aimd", "ds-40-aimd", "qwen-tp8-aimd", "qwen-tp4-wset2", "qwen-tp2-aimd",
        "qwen-tp8-wset-target0.45", "qwen-tp8-wset2-drop_factor2.0",
        "ds-32-hicache-bw10", "ds-32-hicache-host200", "ds-32-hicache-host200-bw2",
        "ds-32-cap16", "qwen-tp2-cap30", "qwen-tp8-uhigh0.4", "qwen-tp8-ulow0.5",
        "stress-ds-spikes-aimd", "stress-long-tail-wset", "stress-shared-prefix-wset-hicache",
        "stress-slow-tools-wset2", "stress-spikes-agent-cap64", "stress-swarm-aimd",
    ],
}  # fmt: skip
# where the committed records are
RECORDS = (PAPER_RESULTS / "paper.json", STRESS_RESULTS / "stress.json")
# the reruns' folders: the stress suite's, as ever (names as in the records)
RUNS = STRESS_RUNS
# wall seconds and where the run folder was differ between machines; everything else must not
VARIABLE = {"wall_seconds", "out"}


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    keys = (set(got) | set(want)) - VARIABLE
    return [
        f"{k}: {want.get(k)!r} -> {got.get(k)!r}" for k in sorted(keys) if got.get(k) != want.get(k)
    ]


def through_cli(rec: dict[str, Any]) -> dict[str, Any]:
    """The figures of `rec`'s run made again by its `cli` line, as its record states them."""
    argv = shlex.split(rec["cli"])
    assert argv[:2] == ["python", "run.py"], rec["cli"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / rec["run"]
        cmd = [sys.executable, str(ROOT / "run.py"), *argv[2:], "--out", str(out), "--quiet"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"run": rec["run"], "exit": done.returncode, "stderr": done.stderr[-2000:]}
        summary = json.loads((out / "summary.json").read_text())
    return {
        "run": rec["run"],
        "sim_seconds": summary["batch_seconds"],
        "by_status": summary["agents_by_status"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", help="run names as in paper.json (e.g. qwen-tp8-wset)")
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=max(1, min(2, mp.cpu_count())))
    p.add_argument("--cli", action="store_true", help="make each run with its `cli` line")
    args = p.parse_args()
    names = [*args.runs, *PRESETS.get(args.preset or "", [])]
    if not names:
        p.error("name runs or a --preset")
    committed: dict[str, dict[str, Any]] = {}
    for f in RECORDS:  # the first file that has a run holds its record
        for r in json.loads(f.read_text()):
            committed.setdefault(r["run"], r)
    by_name = {r.name: r for r in [*plan(None, quick=False), *stress_runs.plan(None, None)]}
    unknown = [n for n in names if n not in by_name or n not in committed]
    if unknown:
        p.error(f"not a run of paper.py or stress.py with a committed record: {unknown}")
    files = ", ".join(str(f.relative_to(ROOT)) for f in RECORDS)
    print(f"{len(names)} runs against {files}, {args.jobs} at a time")
    if args.cli:
        if args.seed != 0:
            p.error("--cli makes the committed runs (seed 0, in their `cli` lines)")
        with mp.get_context("fork").Pool(args.jobs) as pool:
            records = pool.map(through_cli, [committed[n] for n in names], chunksize=1)
        committed = {
            n: {k: committed[n][k] for k in ("run", "sim_seconds", "by_status")} for n in names
        }
    else:
        with mp.get_context("fork").Pool(args.jobs) as pool:
            jobs = [(by_name[n], args.seed) for n in names]
            records = pool.map(functools.partial(execute, runs=RUNS), jobs, chunksize=1)
    bad = 0
    for rec in records:
        diff = differences(rec, committed[rec["run"]])
        bad += bool(diff)
        print(f"{'DIFFERS' if diff else 'same'}: {rec['run']} ({rec.get('sim_seconds')} sim s)")
        for d in diff:
            print(f"    {d}")
    print(f"{len(records) - bad} of {len(records)} runs identical to their committed records")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
