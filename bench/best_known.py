"""The best known schedule of every paper and stress row (issue 31): the fastest run that any
recorded study reached on the row at seed 0 (every policy, its parameter sweeps, task orders,
the host tier, the scheduler variants), with how it was obtained, beside the row's lower
bound (runner/sim/oracle.py). It reads the studies' results files, runs nothing.

    python -m bench.best_known [--check SYSTEM ...]

Writes bench/results/best-known/best-known.{json,md}; `--check` adds each named system's
ratio to the best known (from the paper and stress studies: the criterion of issue 31 is
1.15 on every row). A record is as its study recorded it, with the `cli` line that
reproduces it at that study's commit (bench/results/README.md says which are current).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common.paths import (
    BEST_KNOWN_RESULTS,
    HOST_RESULTS,
    ORDER_RESULTS,
    PAPER_RESULTS,
    RESULTS,
    SCHED_RESULTS,
    STRESS_RESULTS,
)
from bench.common.rows import every_row
from runner.sim.oracle import lower_bounds
from runner.sim.workload import synthetic

OUT = BEST_KNOWN_RESULTS
CRITERION = 1.15
SOURCES = [
    PAPER_RESULTS / "paper.json",
    STRESS_RESULTS / "stress.json",
    HOST_RESULTS / "host-paper.json",
    HOST_RESULTS / "host-stress.json",
    ORDER_RESULTS / "order.json",
    *sorted(SCHED_RESULTS.glob("sched-*.json")),
]


def records(paths: list[Path], seed: int = 0) -> list[dict[str, Any]]:
    """Every run record at `seed` with the row it ran and the file it came from."""
    out = []
    for path in paths:
        if not path.exists() or path.name.endswith("-meta.json"):
            continue
        for r in json.loads(path.read_text()):
            row = r.get("config") or r.get("row")
            if row and "sim_seconds" in r and r.get("seed", 0) == seed:
                how = r["system"] + (f", {r['order']} order" if r.get("order") else "")
                source = str(path.relative_to(RESULTS))
                out.append({"row": row, "seconds": r["sim_seconds"], "how": how,
                            "source": source, "cli": r.get("cli")})  # fmt: skip
    return out


def host_tier(rec: dict[str, Any]) -> bool:
    return "hicache" in rec["how"]


def best_known(recs: list[dict[str, Any]], host: bool) -> dict[str, dict[str, Any]]:
    """Per row, the fastest record with a host tier or without (the first of equals, in the
    sources' order)."""
    best: dict[str, dict[str, Any]] = {}
    for r in recs:
        if host_tier(r) != host:
            continue
        if r["row"] not in best or r["seconds"] < best[r["row"]]["seconds"]:
            best[r["row"]] = r
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", nargs="*", default=["aimd", "wset2"], metavar="SYSTEM")
    a = p.parse_args()
    recs = records(SOURCES)
    best, best_host = best_known(recs, host=False), best_known(recs, host=True)
    # each checked system's own run: the paper and stress studies' (read once, with the rest)
    main = {str(p.relative_to(RESULTS)) for p in SOURCES[:2]}
    main_runs = [r for r in recs if r["source"] in main]
    out, lines = {}, []
    lines += ["# The best known schedule per row (seed 0)", "", __doc__.split("\n\n")[0], ""]
    lines += [
        "A policy runs on the device's pool alone, so its yardstick is the best schedule "
        "without a host tier; the best with one (HiCache, twice the pool) is beside it.",
        "",
    ]
    head = "| row | bound s | best known s | x bound | how | from | with a host tier s (how) |"
    lines += [head + "".join(f" `{s}` / best |" for s in a.check)]
    lines += ["|---" * (7 + len(a.check)) + "|"]
    for key, title, deployment, workload in every_row():
        if key not in best:
            continue
        device, _ = lower_bounds(synthetic(workload, seed=0), deployment)
        b, h = best[key], best_host.get(key)
        bound = device["bound_seconds"]
        mine = {s: [r["seconds"] for r in main_runs if r["row"] == key and r["how"] == s]
                for s in a.check}  # fmt: skip
        ratios = {s: (v[0] / b["seconds"] if v else None) for s, v in mine.items()}
        out[key] = {**b, "title": title, "bound_seconds": bound, "ratios": ratios,
                    "with_host_tier": h}  # fmt: skip
        with_host = "-" if h is None else f"{h['seconds']:,.0f} ({h['how']})"
        cells = "".join(
            " - |" if v is None else f" {v:.2f}{' **over**' if v > CRITERION else ''} |"
            for v in ratios.values()
        )
        lines.append(
            f"| {title} | {bound:,.0f} | {b['seconds']:,.0f} | {b['seconds'] / bound:.2f} | "
            f"{b['how']} | {b['source']} | {with_host} |{cells}"
        )
    lines += ["", f"{len(recs)} records read from {len(SOURCES)} files; **over**: more than "
              f"{CRITERION}x the best known (issue 31's criterion).", ""]  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "best-known.json").write_text(json.dumps(out, indent=1) + "\n")
    (OUT / "best-known.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
