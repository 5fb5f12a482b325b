"""The simulator: engine, runs, workloads, bounds, virtual time (runner/sim/)."""
