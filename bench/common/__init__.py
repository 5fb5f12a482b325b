"""What more than one bench script uses, in one place (imported by module, never star):

- paths: the repository root, bench/results/ and each study's folder in it, the scratch run
  folders under outputs/;
- paper_runs: the CONCUR paper's rows (Table 1) and every run bench.paper makes of them
  (sweeps included), and `execute`, which simulates one run and records it;
- stress_runs: the stress suite's rows and systems, and its runs;
- rows: every row of both (the bound's, the reports'), and which records have a host tier;
- gate_scenarios: the gate's wset2 periods at 10,000 agents (bench.gate_bench times them,
  bench.gate_count counts their instructions) and the helpers of every gate scenario;
- baseline: another git ref's `runner` package, and a child process that imports it.

Nothing here imports `runner` at package import: a --baseline child imports the `runner` of
the ref it measures (bench.common.baseline).
"""
