"""Instructions per control period at 10,000 agents (the default `aimd`, and wset2's two
scenarios), counted by valgrind, turned into time by a calibration measured in the same run,
and set against 1% of an engine step: side by side with a baseline if asked.

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

Time from counts (issue 31): a fixed piece of interpreter work of the gate's kind (sorting,
bisecting, dict and list updates over 20,000 integers: `calibration_work`) is counted under
callgrind once and timed natively, the fastest of 21 runs in this thread's CPU time, so
nanoseconds per instruction on this machine and Python come from the run itself. A period's
time is its count times that; its share is against 1% of an engine step at 10,000 agents
(the simulator's Qwen3-32B TP8 decode of 64 requests at 16K each, as bench.gate_bench
reports it). The conversion holds as far as the period's cache misses are like the
calibration's; the periods miss the last-level cache far more often, so each of their
last-level misses is also counted at 100 ns (a DRAM access) in a second figure
(`us_with_misses`). Both, and the misses, are in the file; in session 15 both stayed below
bench.gate_bench's timed medians, so they are lower estimates, not bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import baseline, gate_scenarios
from bench.common.gate_scenarios import DROPPING_WARMUP
from bench.common.paths import GATE_RESULTS, ROOT
from bench.gate_bench import deployment_steps
from runner.gate.control import Controller

RESULTS = GATE_RESULTS
SCENARIOS = ("aimd", "tools", "dropping")
CALIBRATION_RUNS = 21
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
    if scenario == "calibration":
        calibration_work()  # warm: the counted run is the timed runs' steady state
        functools.reduce(lambda _, __: calibration_work(), [0], None)
    elif scenario == "aimd":
        asyncio.run(gate_scenarios.aimd_periods(10_000, periods))
    elif scenario == "tools":
        asyncio.run(gate_scenarios.wset2_periods(10_000, periods))
    else:
        asyncio.run(gate_scenarios.wset2_dropping_periods(10_000, periods))


MISS_NS = 100.0  # a last-level miss: a DRAM access, taken at its slow end


def convert(side: dict[str, float], ns_per_instruction: float, step_us: float) -> None:
    """A period's time from its counts: its instructions at the calibration's rate, and (a
    second estimate, since the periods miss the last-level cache far more often than the
    calibration) each last-level miss at MISS_NS more; each against 1% of an engine step."""
    side["us"] = side["instructions"] * ns_per_instruction / 1e3
    side["us_with_misses"] = side["us"] + side["last_level_misses"] * MISS_NS / 1e3
    side["share_of_1pct_step"] = side["us"] / (step_us / 100)
    side["share_of_1pct_step_with_misses"] = side["us_with_misses"] / (step_us / 100)


def calibration_work() -> int:
    """Fixed interpreter work of the gate's kind: integers drawn, sorted, bisected, kept in
    a dict and a list (the same instructions every run)."""
    x, items = 12345, []
    for _ in range(20_000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        items.append(x)
    items.sort()
    where: dict[int, int] = {}
    total = 0
    for i, v in enumerate(items[::4]):
        where[v] = i
        total += bisect.bisect_left(items, v)
    return total + len(where)


def calibration_seconds() -> float:
    """The fastest of CALIBRATION_RUNS runs of `calibration_work`, in thread CPU time."""
    calibration_work()
    gc.disable()
    try:
        best = float("inf")
        for _ in range(CALIBRATION_RUNS):
            t = time.thread_time()
            calibration_work()
            best = min(best, time.thread_time() - t)
        return best
    finally:
        gc.enable()


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
    n = 1 if scenario == "calibration" else periods - skip
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
    p.add_argument("--child", choices=(*SCENARIOS, "calibration"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.periods, args.skip)
        return
    record: dict[str, object] = {"periods": args.periods, "skip": args.skip}
    seconds = calibration_seconds()
    calib = count(ROOT, "calibration", 1, 0)
    ns_per_instruction = seconds * 1e9 / calib["instructions"]
    step_us = deployment_steps()["qwen3-32b-tp8_decode_64x16k_us"]
    record["calibration"] = {
        **calib,
        "seconds": seconds,
        "ns_per_instruction": ns_per_instruction,
        "load_average_1min": os.getloadavg()[0],
    }
    record["engine_step_us"] = step_us
    print(
        f"calibration: {calib['instructions']:,.0f} instructions in {seconds * 1e3:.2f} ms: "
        f"{ns_per_instruction:.3f} ns each; 1% of an engine step: {step_us / 100:.0f} us"
    )
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"current": ROOT}
        if args.baseline:
            sides["baseline"] = baseline.baseline_code(args.baseline, Path(tmp))
            record["baseline_ref"] = args.baseline
        for scenario in SCENARIOS:
            got = {
                side: count(code, scenario, args.periods, args.skip) for side, code in sides.items()
            }
            for side in got.values():
                convert(side, ns_per_instruction, step_us)
            record[scenario] = got
            for k, v in got["current"].items():
                base = got.get("baseline", {}).get(k)
                versus = f"   before {base:12,.0f} ({v / base:.3f}x)" if base else ""
                print(f"  {scenario:8s} {k:18s} {v:12,.3f} a period{versus}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS / args.out}")


if __name__ == "__main__":
    main()
