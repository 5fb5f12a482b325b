"""Where the bench reads and writes. Results: bench/results/<study>/, one folder per study
(bench/results/README.md is the index). Run folders of simulated runs: outputs/bench-*/
(scratch, not committed)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
RESULTS = ROOT / "bench" / "results"
OUTPUTS = ROOT / "outputs"

# each study's results folder, by the script that writes it
PAPER_RESULTS = RESULTS / "paper"  # bench.paper (bench.paper_verify reads it)
STRESS_RESULTS = RESULTS / "stress"  # bench.stress
BOUNDS_RESULTS = RESULTS / "bounds"  # bench.bounds
BOUND_GAP_RESULTS = RESULTS / "bound-gap"  # bench.bound_gap
CONSTRUCTED_RESULTS = RESULTS / "constructed-schedule"  # bench.constructed_schedule
SCHED_RESULTS = RESULTS / "sched"  # bench.sched
ORDER_RESULTS = RESULTS / "order"  # bench.order
HOST_RESULTS = RESULTS / "host"  # bench.host_report
GATE_RESULTS = RESULTS / "gate"  # bench.gate_bench, bench.gate_count
CPU_ENGINE_RESULTS = RESULTS / "cpu-engine"  # bench.cpu_engine
EXPORT_RESULTS = RESULTS / "export"  # bench.export_bench
EXPORT_CONSUMERS_RESULTS = RESULTS / "export-consumers"  # bench.export_consumers
LOOP_LAG_RESULTS = RESULTS / "loop-lag"  # bench.loop_lag
SANDBOX_RESULTS = RESULTS / "sandbox"  # bench.sandbox_bench
USERMODE_RESULTS = RESULTS / "usermode"  # bench.usermode_bench
DISK_BOUND_RESULTS = RESULTS / "disk-bound"  # bench.disk_bound_bench
SCALEOUT_RESULTS = RESULTS / "scaleout"  # bench.scaleout_bench
VIEWER_RESULTS = RESULTS / "viewer"  # bench.viewer_bench
SGLANG_RESULTS = RESULTS / "sglang-check"  # bench.sglang_check (on a GPU machine)
FAMILIES_RESULTS = RESULTS / "families"  # bench.families
BEST_KNOWN_RESULTS = RESULTS / "best-known"  # bench.best_known

# the simulated runs' folders (control.jsonl, trajectories, ...), and a subset's results
PAPER_RUNS = OUTPUTS / "bench-paper"
STRESS_RUNS = OUTPUTS / "bench-stress"
SCHED_RUNS = OUTPUTS / "bench-sched"
ORDER_RUNS = OUTPUTS / "bench-order"
FAMILIES_RUNS = OUTPUTS / "bench-families"
