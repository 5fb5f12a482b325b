"""The benchmarks and studies: scripts that measure the runner or reproduce its figures.

Each script is a module run from the repository root, e.g.

    python -m bench.paper --quick
    python -m bench.gate_bench --help

Code two scripts share (the bench rows and runs, paths, the gate scenarios, a baseline
checkout) lives in bench/common/. Results go to bench/results/, one folder per study;
bench/results/README.md says what each holds, the script and command that made it, and
whether it is current. bench/ is not installed with the runner: run it from a checkout.
"""
