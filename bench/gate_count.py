"""Instructions per wset2 control period at 10,000 agents, counted by valgrind: side by side.

    python -m bench.gate_count [--baseline main] [--periods 50] [--out gate-count.json]

bench.gate_bench times the periods in thread CPU time, which on a shared machine moves by
+-50% with the load (other processes on the core evict the caches the period reads): at a
1-minute load of 3-5 on 2 cores it cannot tell 10-20% apart. This counts instead, under
callgrind with its cache simulation (D1/I1 32 KiB, a 2 MiB last level), the instructions and
the cache misses of each `Controller.step` of gate_bench's two wset2 scenarios (holders in
long tools; ~900 past the drop time every period: bench/common/gate_scenarios.py), after
their first periods (`--skip`: the first admits 6,394 agents, the 17th builds the
least-waited heap; gate_bench's means count them, the counts here are of the steady
periods). Deterministic: the hash seed is fixed and gc is off in the counted process (a
collection landing in a period or not would move the count by more than the code does).
Needs valgrind (`apt-get install valgrind`); each side and scenario takes 1-2 minutes.
Writes bench/results/gate/gate-count.json (or --out there).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import baseline, gate_scenarios
from bench.common.gate_scenarios import DROPPING_WARMUP
from bench.common.paths import GATE_RESULTS, ROOT
from runner.gate.control import Controller

RESULTS = GATE_RESULTS
SCENARIOS = ("tools", "dropping")
# callgrind's summary fields, in its order
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


def child(scenario: str, periods: int, skip: int) -> None:
    """Run one scenario with every step after the first `skip` inside functools.reduce, the
    C function callgrind collects in (--toggle-collect): a Python function has no symbol."""
    baseline.check_runner()  # the child imports `runner` from the code its parent named

    step, seen = Controller.step, [0]

    def counted(self: Controller) -> object:
        seen[0] += 1
        if seen[0] <= skip:
            return step(self)
        return functools.reduce(lambda _, __: step(self), [0], None)

    Controller.step = counted  # type: ignore[assignment, method-assign]
    gc.disable()
    if scenario == "tools":
        asyncio.run(gate_scenarios.wset2_periods(10_000, periods))
    else:
        asyncio.run(gate_scenarios.wset2_dropping_periods(10_000, periods))


def count(code: Path, scenario: str, periods: int, skip: int) -> dict[str, float]:
    """Per counted period: instructions, and I1 / D1 and last-level misses."""
    skipped = skip + (DROPPING_WARMUP if scenario == "dropping" else 0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = [
            "valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce",
            "--cache-sim=yes", "--LL=2097152,16,64", f"--callgrind-out-file={out}",
            sys.executable, "-m", "bench.gate_count", "--child", scenario,
            "--periods", str(periods), "--skip", str(skipped),
        ]  # fmt: skip
        run = baseline.child(code)
        run["env"]["PYTHONHASHSEED"] = "0"
        subprocess.run(argv, **run, check=True, capture_output=True)
        line = next(
            x for x in out.read_text().splitlines() if x.startswith(("summary:", "totals:"))
        )
    v = dict(zip(EVENTS, map(int, line.split()[1:]), strict=True))
    n = periods + (DROPPING_WARMUP if scenario == "dropping" else 0) - skipped
    return {
        "instructions": v["Ir"] / n,
        "l1_misses": (v["I1mr"] + v["D1mr"] + v["D1mw"]) / n,
        "last_level_misses": (v["ILmr"] + v["DLmr"] + v["DLmw"]) / n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", metavar="REF", help="also count the gate at this git ref")
    p.add_argument("--periods", type=int, default=50)
    p.add_argument("--skip", type=int, default=20, help="first periods not counted")
    p.add_argument("--out", default="gate-count.json", help="file name under bench/results/gate/")
    p.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.periods, args.skip)
        return
    record: dict[str, object] = {"periods": args.periods, "skip": args.skip}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"current": ROOT}
        if args.baseline:
            sides["baseline"] = baseline.baseline_code(args.baseline, Path(tmp))
            record["baseline_ref"] = args.baseline
        for scenario in SCENARIOS:
            got = {
                side: count(code, scenario, args.periods, args.skip) for side, code in sides.items()
            }
            record[scenario] = got
            for k, v in got["current"].items():
                base = got.get("baseline", {}).get(k)
                versus = f"   before {base:12,.0f} ({v / base:.3f}x)" if base else ""
                print(f"  wset2 {scenario:8s} {k:18s} {v:12,.0f} a period{versus}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS / args.out}")


if __name__ == "__main__":
    main()
