"""Simulation: the real runner (agent loop, gate, policies, store) against a simulated
SGLang-like engine on virtual time. Nothing outside this package imports it, except the CLI's
`--engine sim` entry and the benchmarks.

- simulate.py: one simulated batch (`simulate`), the entry point of bench/paper.py
- workload.py: workloads (synthetic presets, trace files) and the scripted model
- engine/: the simulated engine (radix cache, scheduler, roofline cost model, deployments)
- oracle.py: lower bounds on a workload's batch time
- vclock.py: the virtual-time event loop
- tools.py: the simulated tool and the sandbox of simulated runs
"""
