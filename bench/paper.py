"""Reproduce the CONCUR paper's experiments in simulation (runner/sim/simulate.py).

    python -m bench.paper                 # everything (~see the report for wall times)
    python -m bench.paper --quick         # Table 1 only
    python -m bench.paper --only qwen-tp8 # one configuration
    python -m bench.paper --systems wset,wset2,wset2-sweep  # a subset, into outputs/

Writes bench/results/paper/paper.md (the paper's number beside ours in every cell), paper.json
(one record per run) and timeline PNGs; each run's folder (control.jsonl, trajectories...)
goes to outputs/bench-paper/<run>/. The rows and runs: bench/common/paper_runs.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from bench.common.paper_runs import (
    CONTROL_PERIOD,
    CRITERION_CAPS,
    FIXED_CAPS,
    HICACHE_RATIO,
    HICACHE_VARIANTS,
    REQUEST_CAP,
    ROBUST_ROWS,
    ROBUSTNESS,
    SWEEP_U_HIGH,
    SWEEP_U_LOW,
    SYSTEMS,
    TABLE1,
    Run,
    execute,
    plan,
)
from bench.common.paths import PAPER_RESULTS, PAPER_RUNS
from runner.sim.oracle import lower_bound, lower_bounds
from runner.sim.workload import synthetic

RESULTS = PAPER_RESULTS
RUNS = PAPER_RUNS
# The default-policy criterion (issue 16): within CRITERION x the row's lower bound, and never
# slower than none, aimd or the best of the fixed caps CRITERION_CAPS.
CRITERION = 1.3
CANDIDATES = ("wset", "wset2")  # the policies the criterion is checked for
HICACHE_CHECKED = "host200-bw2"  # the variant the checks also report


# ---- report ---------------------------------------------------------------------------


DISAGREEMENTS = """## Where the simulation disagrees with the paper, and why

- **Absolute seconds.** The workload is synthetic (`runner/sim/workload.py`, preset `paper`):
  256 agents, 10-50 steps, contexts from 512 to 16-32K tokens, 40-200 generated tokens and
  a 1-8 s tool per step. The paper does not publish its traces; with this one, decode of the
  contexts alone costs the simulated TP2 deployment more than the paper's whole CONCUR run
  (846 s), so the paper's agents must have had shorter contexts or replies. Ratios between
  systems are the meaningful output, not seconds.
- **U_high barely matters here.** U is SGLang's `token_usage`: tokens held by running
  requests and locked prefixes, excluding evictable cache. With multi-second tools most of
  the resident KV belongs to agents in tools, which is evictable, so under AIMD U rarely
  passes 0.4 while H is below 0.2: the decrease branch seldom fires and the window is set by
  U_low (which does matter: see the U_low sweep). The paper's 4-5x slowdown at U_high=0.8
  implies a U that counts more of the pool than `token_usage` does.
  More variants measured in session 2 (Qwen, U_high 0.5 vs 0.8): an initial window of all
  256 agents (TP8 673 / 673 s, TP2 3,355 / 3,279 s) and 2-30 s or 5-60 s tools instead of
  1-8 s (TP8 1,056 / 1,067 s and 1,847 / 1,841 s), and replies of 400-2,400 tokens, as a
  thinking model writes (TP8 3,643 / 3,643 s, TP2 22,529 / 20,627 s): no slowdown at 0.8.
  When this model thrashes (the uncontrolled runs) U sits at 0.85-0.94, because the running
  batch fills the pool, so a cut fires at either threshold; under the gate, periods with H <
  0.2 are rare (TP8 with the 256-agent start: 8-9 cuts in 673 periods). The paper's result
  needs long thrashing at a U between 0.5 and 0.8, which this engine model does not produce.
- **HiCache is cheaper in the model than on the paper's machines.** The model charges host
  to GPU reloads at 50 GB/s per GPU, not overlapped, and treats write-through copies as
  free; where the host tier holds the whole working set (TP8, DeepSeek) HiCache then avoids
  all recomputation and beats AIMD. The paper measured HiCache slower than the plain engine
  on DeepSeek (2,559 vs 873 s), i.e. transfer and synchronisation costs this model lacks.
  Where the working set exceeds the host tier too (TP4, TP2) HiCache thrashes and AIMD wins
  by 3x. The sensitivity table above asks what reload rate the paper's HiCache numbers
  imply. Where the 2x host tier holds the working set (TP8, DeepSeek-32/40) HiCache falls
  behind aimd only when reloads are slow: below about 16 GB/s per GPU at TP8 (at 10 GB/s 634
  s vs 555 s; at 2 GB/s 0.73 of none, the paper 0.66) and below about 4 GB/s on
  DeepSeek-32/40; on DeepSeek-32 it is slower than none, as in the paper, below about 2 GB/s
  (the run time is linear in 1 / rate: fitted to the 50, 10 and 2 GB/s runs). The other rows
  do not depend on the rate: at TP4/TP2 the 2x host tier is too small for the working set
  (200 GB per rank lifts TP4's hit rate from 25% to 87%, TP2's only to 21%; the paper's TP2
  HiCache, 0.44 of none, implies more), DeepSeek-16 has no pressure, and the paper's
  DeepSeek-40 baseline collapsed (3,877 s) far more than this model's. Plausible causes of
  slow reloads, from SGLang's own tracker: with the default page size of 1 the KV to move is
  fragmented into many small copies (PR 7313, "poor bandwidth utilization ... particularly
  pronounced when using small page sizes", which added transfer kernels that did not work
  with FA3, Hopper's default attention backend); deployments were later pinned to the slower
  `direct` I/O backend for stability (PR 21631); CPU-side copy submission prevented
  overlapping loads with the forward pass (PR 18113); issue 7059 shows HiCache with no gain
  (TTFT 12.8 s vs 10.5 s at 32K inputs) and issue 12770 a throughput drop after a pressure
  test. The default stays at the copy-engine rate, the model's physical assumption; the
  checks report both.
- **DeepSeek-V3 with 16 agents has no pressure here.** Their working set fits the calibrated
  280K-token pool for most of the run, so every system takes the same time; the paper's
  baseline had an 80% hit rate there, i.e. more pressure than this workload creates.
  Larger DeepSeek contexts do not fix it (measured in session 2, uncontrolled hit rate at
  16 / 32 / 40 agents): final contexts of 24-48K give 91 / 21 / 14%, 32-64K give
  53 / 13 / 12%, against the paper's 80 / 78 / 35%. In a capacity model the hit rate falls
  off one cliff as agents are added; the paper's is flat from 16 to 32 agents and then
  falls, which no single context scale reproduces. The preset keeps the Qwen agents.
"""


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def report(records: list[dict[str, Any]], wall: float, seed: int) -> str:
    by = {r["run"]: r for r in records}
    out = ["# CONCUR paper experiments, reproduced in simulation", ""]
    out.append(
        f"Generated by `python -m bench.paper` (seed {seed}); {len(records)} simulated runs took "
        f"{wall:.0f} s of wall time on this machine. Simulated seconds come from the roofline "
        "cost model of `docs/simulator.md`; they are a model, not measurements on H100s. "
        f"`request-cap` uses N={REQUEST_CAP} (the paper does not give its N); `hicache` is "
        f"the uncontrolled engine with a host tier of {HICACHE_RATIO:g}x the device pool. "
        f"Control period {CONTROL_PERIOD:g} s. DeepSeek-V3's pool is capped at 280K tokens "
        "(the `deepseek-v3-tp16-paper` preset, calibrated to the paper's 6.67 GB per 4,096 "
        "tokens). Every run's `run.py` command line, which reproduces its seconds exactly, is "
        "its `cli` field in paper.json."
    )
    out += ["", "## Table 1: seconds to finish the batch (paper / simulated)", ""]
    out.append("| configuration | " + " | ".join(SYSTEMS) + " | aimd vs none (paper / sim) |")
    out.append("|---" * (len(SYSTEMS) + 2) + "|")
    for c in TABLE1:
        cells = []
        for s in SYSTEMS:
            r = by.get(f"{c.key}-{s}")
            cells.append(f"{_fmt(c.paper.get(s))} / {_fmt(r and r['sim_seconds'])}")
        none, aimd = by.get(f"{c.key}-none"), by.get(f"{c.key}-aimd")
        ps = c.paper["none"] / c.paper["aimd"]
        ss = none["sim_seconds"] / aimd["sim_seconds"] if none and aimd else None
        out.append(f"| {c.title} | " + " | ".join(cells) + f" | {ps:.2f}x / {_fmt(ss, 2)}x |")
    out += ["", "## Achieved / oracle lower bound", ""]
    out.append(
        "The bound (runner/sim/oracle.py) is the longest of: the engine's work with nothing "
        "recomputed and no idle GPU at full batch; the same plus the cheapest recomputes "
        "that let the KV pool hold every context while its agent generates or runs a tool "
        "(memory-time); the longest agent's serial chain. `hicache` is divided by the "
        "bound with a host tier (reloads instead of recomputes). A ratio near 1 leaves "
        "nothing to gain."
    )
    out.append("")
    out.append(
        "| configuration | bound s (engine / memory / chain) | "
        + " | ".join(SYSTEMS)
        + " | wset vs aimd |"
    )
    out.append("|---" * (len(SYSTEMS) + 3) + "|")
    for c in TABLE1:
        workload = synthetic(c.workload, seed=seed)
        b, b_host = lower_bounds(workload, c.deployment)
        cells = []
        for s_ in SYSTEMS:
            r = by.get(f"{c.key}-{s_}")
            bound = (b_host if s_.endswith("hicache") else b)["bound_seconds"]
            cells.append(_fmt(r and r["sim_seconds"] / bound, 2))
        a, w = by.get(f"{c.key}-aimd"), by.get(f"{c.key}-wset")
        vs = a["sim_seconds"] / w["sim_seconds"] if a and w else None
        out.append(
            f"| {c.title} | {b['bound_seconds']:,.0f} ({b['engine_bound_seconds']:,.0f}"
            f" / {b['memory_bound_seconds']:,.0f} / {b['longest_chain_seconds']:,.0f}) | "
            + " | ".join(cells)
            + f" | {_fmt(vs, 2)}x |"
        )
    out += criterion_section(by, seed)
    out += robustness_section(by)
    out += _hicache_section(by)
    out += ["", "## Prefix-cache hit rate, % (paper / simulated; device+host hits)", ""]
    out.append("| configuration | " + " | ".join(SYSTEMS) + " |")
    out.append("|---" * (len(SYSTEMS) + 1) + "|")
    for c in TABLE1:
        cells = []
        for s in SYSTEMS:
            r = by.get(f"{c.key}-{s}")
            hit = r and r["hit_rate"] is not None and 100 * r["hit_rate"]
            cells.append(f"{_fmt(c.paper_hit.get(s), 1)} / {_fmt(hit or None, 1)}")
        out.append(f"| {c.title} | " + " | ".join(cells) + " |")
    out += ["", "## Where the time went (simulated)", ""]
    out.append(
        "Engine seconds by kind (prefill of new tokens, recompute of evicted tokens, "
        "decode, host-memory loads, idle) and per-agent means (tool, waiting at the gate, "
        "in the engine)."
    )
    out += [
        "",
        "| run | total s | prefill | recompute | decode | host load | idle | retractions"
        " | agent: tool | gate wait | engine |",
        "|---" * 11 + "|",
    ]
    for r in records:
        e = r["engine"]
        a = r["agents"]
        out.append(
            f"| {r['run']} | {_fmt(r['sim_seconds'])} | {_fmt(e.get('seconds_prefill_new'))} | "
            f"{_fmt(e.get('seconds_prefill_recompute'))} | {_fmt(e.get('seconds_decode'))} | "
            f"{_fmt(e.get('seconds_host_load'))} | {_fmt(e.get('seconds_idle'))} | "
            f"{e.get('retractions', '-')} | {_fmt(a['tool_seconds'])} | "
            f"{_fmt(a['wait_seconds'])} | {_fmt(a['gen_seconds'])} |"
        )
    if any(
        r["config"] == FIXED_CAPS["config"] and r["system"].startswith("agent-cap") for r in records
    ):
        key = FIXED_CAPS["config"]
        out += [
            "",
            f"## Fixed agent caps ({key}; paper: best fixed cap ~"
            f"{FIXED_CAPS['paper_best']} s vs aimd 846 s)",
            "",
        ]
        out += ["| system | simulated s |", "|---|---|"]
        for r in records:
            if r["config"] == key and (
                r["system"].startswith("agent-cap") or r["system"] in ("aimd", "none")
            ):
                out.append(f"| {r['system']} | {_fmt(r['sim_seconds'])} |")
    for title, sweep, knob in (
        ("U_high (U_low = 0.2)", SWEEP_U_HIGH, "uhigh"),
        ("U_low (U_high = 0.5)", SWEEP_U_LOW, "ulow"),
    ):
        rows = []
        for key, paper in sweep.items():
            cells = []
            for v, ps in paper.items():
                default = (knob == "uhigh" and v == 0.5) or (knob == "ulow" and v == 0.2)
                r = by.get(f"{key}-aimd" if default else f"{key}-{knob}{v}")
                cells.append(f"{ps:,} / {_fmt(r and r['sim_seconds'])}")
            if any(not c.endswith("/ -") for c in cells):
                rows.append(f"| {key} | " + " | ".join(cells) + " |")
        if rows:
            vals = list(next(iter(sweep.values())))
            out += ["", f"## Threshold sensitivity, {title}: seconds (paper / simulated)", ""]
            out.append("| configuration | " + " | ".join(str(v) for v in vals) + " |")
            out.append("|---" * (len(vals) + 1) + "|")
            out += rows
    out += ["", "## Checks against the paper's claims", ""]
    out += checks(records)
    out += ["", DISAGREEMENTS]
    out += ["", "## Identical work", ""]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["config"], []).append(r)
    for key, rs in groups.items():
        same = all(r["work_digest"] == rs[0]["work_digest"] for r in rs)
        toks = rs[0]["work_tokens"]
        out.append(
            f"- {key}: {len(rs)} runs, {'identical' if same else 'DIFFERENT'} steps, "
            f"context and generated tokens per agent ({toks:,} context tokens in all)"
        )
    out += ["", "## Timelines", ""]
    for c in TABLE1:
        if (RESULTS / f"timeline-{c.key}.png").exists():
            out.append(f"![{c.title}](timeline-{c.key}.png)")
    return "\n".join(out) + "\n"


def _phases(run_dir: str) -> tuple[float, float, float] | None:
    """Hit rate in the three phases of a run: the best 5-period mean in the first 10% of the
    time (warmup), the median over 10-90% (middle), the best 5-period mean in the last 5%
    (cooldown). Phases are short at the ends, hence best rolling means rather than means."""
    lines = [json.loads(x) for x in (Path(run_dir) / "control.jsonl").read_text().splitlines()]
    hs = [(x["t"], x["h"]) for x in lines if x["h"] is not None]
    if len(hs) < 10:
        return None
    end = hs[-1][0] or 1.0

    def best(lo: float, hi: float) -> float:
        v = [h for t, h in hs if lo <= t / end <= hi]
        means = [sum(v[i : i + 5]) / len(v[i : i + 5]) for i in range(max(1, len(v) - 4))]
        return max(means, default=float("nan"))

    middle = sorted(h for t, h in hs if 0.1 <= t / end <= 0.9)
    return best(0, 0.1), middle[len(middle) // 2] if middle else float("nan"), best(0.95, 1.0)


def _hicache_section(by: dict[str, dict[str, Any]]) -> list[str]:
    variants = {"": ("2x host, 50 GB/s", None, None), **HICACHE_VARIANTS}

    def run(cfg: str, key: str) -> dict[str, Any] | None:
        return by.get(f"{cfg}-hicache-{key}" if key else f"{cfg}-hicache")

    if not any(run(c.key, k) for c in TABLE1 for k in HICACHE_VARIANTS):
        return []
    out = ["", "## HiCache: reload rate and host size (sensitivity)", ""]
    out.append(
        "The uncontrolled engine with a host tier: SGLang's default 2x the device pool or "
        "200 GB per rank (a DGX H100's 2 TB of RAM over 8 GPUs), reloads charged at the "
        "model's 50 GB/s per GPU (a pinned copy-engine rate) or slower effective rates. "
        "Cells: seconds (ratio to `none`), hit rate; the paper column is the paper's "
        "HiCache / SGLang."
    )
    out.append("")
    out.append(
        "| configuration | paper HiCache / none | "
        + " | ".join(v[0] for v in variants.values())
        + " | aimd |"
    )
    out.append("|---" * (len(variants) + 3) + "|")
    errors: dict[str, list[float]] = {k: [] for k in variants}
    for c in TABLE1:
        none, aimd = by.get(f"{c.key}-none"), by.get(f"{c.key}-aimd")
        if not none:
            continue
        paper = c.paper["hicache"] / c.paper["none"]
        cells = []
        for k in variants:
            r = run(c.key, k)
            if r is None:
                cells.append("-")
                continue
            x = r["sim_seconds"] / none["sim_seconds"]
            errors[k].append(abs(math.log(x / paper)))
            cells.append(f"{r['sim_seconds']:,.0f} ({x:.2f}), {100 * (r['hit_rate'] or 0):.0f}%")
        aimd_cell = (
            f"{aimd['sim_seconds']:,.0f}, {100 * (aimd['hit_rate'] or 0):.0f}%" if aimd else "-"
        )
        out.append(f"| {c.title} | {paper:.2f} | " + " | ".join(cells) + f" | {aimd_cell} |")
    fit = ", ".join(
        f"{variants[k][0]} {math.exp(sum(e) / len(e)):.2f}x" for k, e in errors.items() if e
    )
    out += [
        "",
        "Geometric mean factor between the simulated and the paper's HiCache / none ratio "
        f"over the rows above (1.00x = the paper's ratios exactly): {fit}.",
    ]
    return out


def robustness_section(by: dict[str, dict[str, Any]]) -> list[str]:
    """Each candidate's parameters at -50% / +100%, per Qwen row: time against defaults'."""
    out: list[str] = []
    for pol, sweep in ROBUSTNESS.items():
        rows = [k for k in ROBUST_ROWS if f"{k}-{pol}" in by]
        if not rows:
            continue
        out += ["", f"## {pol} robustness: each parameter at -50% and +100% (time / defaults')"]
        out += ["", "| parameter | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
        out.append(
            "| defaults (s) | "
            + " | ".join(f"{by[f'{k}-{pol}']['sim_seconds']:,.0f}" for k in rows)
            + " |"
        )
        worst = 0.0
        for param, values in sweep.items():
            for v in values:
                cells = []
                for k in rows:
                    r = by.get(f"{k}-{pol}-{param}{v}")
                    x = r and r["sim_seconds"] / by[f"{k}-{pol}"]["sim_seconds"]
                    worst = max(worst, abs(x - 1) if x else 0.0)
                    cells.append(_fmt(x, 2))
                out.append(f"| {param}={v} | " + " | ".join(cells) + " |")
        out += ["", f"Largest move: {worst:.0%} (criterion: under 15% on every Qwen row)."]
    return out


def criterion_section(by: dict[str, dict[str, Any]], seed: int) -> list[str]:
    """Issue 16's criterion for each candidate default, row by row."""
    out = ["", "## Default-policy criterion: " + ", ".join(f"`{c}`" for c in CANDIDATES), ""]
    out.append(
        f"PASS needs the candidate within {CRITERION}x of the row's lower bound and no slower "
        "than none, aimd or the best of agent-cap:" + "/".join(map(str, CRITERION_CAPS)) + "."
    )
    out += ["", "| row | bound s | candidate | s | / bound | best baseline | vs it | verdict |"]
    out.append("|---" * 8 + "|")
    for c in TABLE1:
        base = [by.get(f"{c.key}-{s}") for s in ("none", "aimd")]
        base += [by.get(f"{c.key}-cap{n}") for n in CRITERION_CAPS]
        base = [r for r in base if r]
        b = lower_bound(synthetic(c.workload, seed=seed), c.deployment)["bound_seconds"]
        for name in CANDIDATES:
            cand = by.get(f"{c.key}-{name}")
            if not cand or not base:
                continue
            best = min(base, key=lambda r: r["sim_seconds"])
            ratio, vs = cand["sim_seconds"] / b, best["sim_seconds"] / cand["sim_seconds"]
            ok = ratio <= CRITERION and vs >= 1.0
            out.append(
                f"| {c.title} | {b:,.0f} | {name} | {cand['sim_seconds']:,.0f} | {ratio:.2f} | "
                f"{best['system']} {best['sim_seconds']:,.0f} | {vs:.2f}x | "
                f"{'PASS' if ok else 'FAIL'} |"
            )
    return out


def checks(records: list[dict[str, Any]]) -> list[str]:
    by = {r["run"]: r for r in records}
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'PASS' if ok else 'FAIL'}: {text}")

    for c in TABLE1:
        none = by.get(f"{c.key}-none")
        if none:
            ph = _phases(none["out"])
            if ph:
                ok = ph[0] > 0.6 and ph[1] < ph[0] - 0.3 and ph[2] > ph[1] + 0.3
                line(
                    ok,
                    f"{c.key} uncontrolled: three phases, H warmup {ph[0]:.2f}, "
                    f"middle {ph[1]:.2f}, cooldown {ph[2]:.2f}; recompute "
                    f"{none['engine']['seconds_prefill_recompute'] / none['sim_seconds']:.0%}"
                    " of the time",
                )
    for c in TABLE1:
        none, aimd = by.get(f"{c.key}-none"), by.get(f"{c.key}-aimd")
        if none and aimd:
            x = none["sim_seconds"] / aimd["sim_seconds"]
            need = 2.0 if c.key.startswith("qwen") else 1.0
            # three decimals: a 0.2% difference must not read as a clear win
            line(x > need, f"{c.key}: aimd {x:.3f}x faster than none (claim: > {need:g}x)")
    caps = [
        r
        for r in records
        if r["config"] == FIXED_CAPS["config"]
        and r["system"] in {f"agent-cap:{n}" for n in FIXED_CAPS["caps"]}
    ]
    aimd = by.get(f"{FIXED_CAPS['config']}-aimd")
    if caps and aimd:
        best = min(caps, key=lambda r: r["sim_seconds"])
        line(
            aimd["sim_seconds"] < best["sim_seconds"],
            f"{FIXED_CAPS['config']}: aimd {aimd['sim_seconds']:,.0f} s vs best fixed cap "
            f"{best['system']} {best['sim_seconds']:,.0f} s",
        )
    for key in SWEEP_U_HIGH:
        base, high = by.get(f"{key}-aimd"), by.get(f"{key}-uhigh0.8")
        if base and high:
            x = high["sim_seconds"] / base["sim_seconds"]
            line(x > 2, f"{key}: U_high 0.8 is {x:.2f}x the time of 0.5 (paper: 4-5x)")
    for c in TABLE1:
        rs = [by.get(f"{c.key}-{s}") for s in SYSTEMS]
        if all(rs):
            hic, aimd = by[f"{c.key}-hicache"], by[f"{c.key}-aimd"]
            top = max(rs, key=lambda r: r["hit_rate"] or 0)
            line(
                top is hic or top["hit_rate"] == hic["hit_rate"],
                f"{c.key}: HiCache has the highest hit rate ({hic['hit_rate']:.1%}; aimd "
                f"{aimd['hit_rate']:.1%})",
            )
            line(
                aimd["sim_seconds"] < hic["sim_seconds"],
                f"{c.key}: aimd {aimd['sim_seconds']:,.1f} s vs HiCache "
                f"{hic['sim_seconds']:,.1f} s",
            )
            alt = by.get(f"{c.key}-hicache-{HICACHE_CHECKED}")
            if alt:
                label = HICACHE_VARIANTS[HICACHE_CHECKED][0]
                others = [r for r in rs if r is not hic]
                line(
                    all((alt["hit_rate"] or 0) >= (r["hit_rate"] or 0) for r in others),
                    f"{c.key}: HiCache ({label}) has the highest hit rate "
                    f"({alt['hit_rate'] or 0:.1%}; aimd {aimd['hit_rate'] or 0:.1%}) (sensitivity)",
                )
                line(
                    aimd["sim_seconds"] < alt["sim_seconds"],
                    f"{c.key}: aimd {aimd['sim_seconds']:,.1f} s vs HiCache ({label}) "
                    f"{alt['sim_seconds']:,.1f} s (sensitivity)",
                )
    return out


def timelines(records: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no PNG timelines: pip install matplotlib)")
        return
    for c in TABLE1:
        runs = [r for r in records if r["config"] == c.key and r["system"] in SYSTEMS]
        if not runs:
            continue
        fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
        for r in runs:
            lines = [
                json.loads(x) for x in (Path(r["out"]) / "control.jsonl").read_text().splitlines()
            ]
            t = [x["t"] for x in lines]
            axes[0].step(t, [x["w_after"] for x in lines], where="post", label=r["system"])
            axes[1].plot(t, [x["u"] for x in lines], label=r["system"])
            axes[2].plot(t, [x["h"] for x in lines], ".", ms=2, label=r["system"])
            axes[3].plot(t, [x["active"] for x in lines], label=f"{r['system']} active")
            axes[3].plot(t, [x["finished"] for x in lines], "--", label=f"{r['system']} finished")
        for ax, name in zip(axes, ["window W", "KV usage U", "hit rate H", "agents"], strict=True):
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        axes[3].legend(fontsize=6, ncol=2)
        axes[-1].set_xlabel("simulated seconds")
        fig.suptitle(c.title)
        fig.tight_layout()
        fig.savefig(RESULTS / f"timeline-{c.key}.png", dpi=80)
        plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description="CONCUR paper experiments in simulation")
    p.add_argument("--only", help="one configuration key, e.g. qwen-tp8")
    p.add_argument("--quick", action="store_true", help="Table 1 only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=max(1, min(2, mp.cpu_count())))
    p.add_argument(
        "--systems",
        help="comma-separated subset of: "
        + ", ".join(SYSTEMS)
        + ", agent-cap:N, "
        + ", ".join(f"{p}-sweep" for p in ROBUSTNESS)
        + " (a policy's robustness sweep); results go to outputs/, not results/",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite paper.md and the PNGs from paper.json and the run folders",
    )
    args = p.parse_args()
    if args.report_only:
        records = json.loads((RESULTS / "paper.json").read_text())
        wall = json.loads((RESULTS / "paper-meta.json").read_text())["wall_seconds"]
        timelines(records)
        (RESULTS / "paper.md").write_text(report(records, wall, args.seed))
        print(f"rewrote {RESULTS / 'paper.md'}")
        return
    runs = plan(args.only, args.quick)
    systems = set(args.systems.split(",")) if args.systems else None
    if systems is not None:
        runs = [r for r in runs if r.system in systems or f"{_sweep_of(r)}-sweep" in systems]
    print(f"{len(runs)} simulated runs, {args.jobs} at a time")
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(args.jobs) as pool:
        records = pool.map(
            functools.partial(execute, runs=RUNS), [(r, args.seed) for r in runs], chunksize=1
        )
    wall = time.perf_counter() - t0
    dest = RUNS if systems is not None else RESULTS  # a subset never overwrites the results
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "paper.json").write_text(json.dumps(records, indent=1) + "\n")
    (dest / "paper-meta.json").write_text(
        json.dumps({"wall_seconds": wall, "runs": len(runs), "seed": args.seed}) + "\n"
    )
    if systems is None:
        timelines(records)
    (dest / "paper.md").write_text(report(records, wall, args.seed))
    print(f"wrote {dest / 'paper.md'} and paper.json in {wall:.0f} s")


def _sweep_of(run: Run) -> str | None:
    """The policy whose robustness sweep a run belongs to, if it is one."""
    pol = run.policy + ("+hicache" if run.hicache else "")
    return pol if pol in ROBUSTNESS and run.policy_options else None


if __name__ == "__main__":
    main()
