"""What the sandbox costs: spawn latency of a sandboxed `true` against a bare subprocess, and
tool calls per second at 1, 16 and 128 concurrent calls (each concurrent slot its own agent
uid and workspace, as in a batch).

    python -m bench.sandbox_bench [--spawns 200] [--calls-per-slot 4] [--tools bash,python]

Needs root and bubblewrap. Prints a table and writes bench/results/sandbox/sandbox.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.paths import SANDBOX_RESULTS
from tools.core import ToolContext
from tools.registry import get_tools
from tools.sandbox import BwrapSandbox, Limits

RESULTS = SANDBOX_RESULTS
UID0 = 250000  # clear of the batch (200000+) and test (210000-239999) uids
CALLS = {
    "bash": {"command": "echo ok"},
    "python": {"code": "print('ok')"},
    "str_replace_editor": {"command": "view", "path": "/work/f.py"},
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def stats_ms(xs: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in xs]
    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 2),
        "p95_ms": round(pct(ms, 0.95), 2),
        "min_ms": round(min(ms), 2),
    }


def bare_spawns(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["/usr/bin/true"], check=True)
        out.append(time.perf_counter() - t)
    return out


async def sandbox_spawns(sb: BwrapSandbox, ws: Path, uid: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = await sb.run("true", ws, uid, Limits(timeout_s=30))
        out.append(time.perf_counter() - t)
        assert r.exit_code == 0, r.output
    return out


async def throughput(
    sb: BwrapSandbox, base: Path, tool_name: str, slots: int, per_slot: int
) -> dict[str, float]:
    tool = get_tools([tool_name])[tool_name]
    args = CALLS[tool_name]
    ctxs = []
    for i in range(slots):
        ws = base / f"slot{i}"
        if not ws.exists():
            ws.mkdir()
            (ws / "f.py").write_text("print('hello')\n" * 20)
        sb.prepare_workspace(ws, UID0 + 1 + i)
        ctxs.append(ToolContext(ws, UID0 + 1 + i, sb, Limits(timeout_s=120)))
    latencies: list[float] = []
    failures = 0

    async def slot(ctx: ToolContext) -> None:
        nonlocal failures
        for _ in range(per_slot):
            t = time.perf_counter()
            o = await tool(dict(args), ctx)
            latencies.append(time.perf_counter() - t)
            failures += not o.ok

    t0 = time.perf_counter()
    await asyncio.gather(*(slot(c) for c in ctxs))
    wall = time.perf_counter() - t0
    return {
        "tool": tool_name,
        "concurrency": slots,
        "calls": slots * per_slot,
        "failures": failures,
        "wall_s": round(wall, 3),
        "calls_per_s": round(slots * per_slot / wall, 1),
        "latency_median_ms": round(statistics.median(latencies) * 1000, 1),
        "latency_p95_ms": round(pct(latencies, 0.95) * 1000, 1),
    }


async def main_async(args: argparse.Namespace) -> dict:
    sb = BwrapSandbox()
    base = Path(tempfile.mkdtemp(prefix="sandbox-bench-", dir="/tmp"))
    base.chmod(0o711)
    try:
        ws = base / "spawn"
        sb.prepare_workspace(ws, UID0)
        await sandbox_spawns(sb, ws, UID0, 5)  # warm the page cache
        bare = bare_spawns(args.spawns)
        boxed = await sandbox_spawns(sb, ws, UID0, args.spawns)
        spawn = {"bare_subprocess": stats_ms(bare), "sandboxed": stats_ms(boxed)}
        spawn["overhead_median_ms"] = round(
            spawn["sandboxed"]["median_ms"] - spawn["bare_subprocess"]["median_ms"], 2
        )
        rows = []
        for name in args.tools.split(","):
            for c in (1, 16, 128):
                per_slot = max(args.calls_per_slot, 64 // c) if c < 128 else args.calls_per_slot
                rows.append(await throughput(sb, base, name, c, per_slot))
        await sb.aclose()
        return {"spawn": spawn, "throughput": rows}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spawns", type=int, default=200, help="sequential spawns per kind")
    p.add_argument("--calls-per-slot", type=int, default=4, help="calls each concurrent slot makes")
    p.add_argument("--tools", default="bash,python,str_replace_editor", help="tools to measure")
    args = p.parse_args()
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        print("sandbox_bench: needs root and bubblewrap (apt-get install -y bubblewrap)")
        return 2
    res = asyncio.run(main_async(args))
    s = res["spawn"]
    print(f"spawn `true` ({args.spawns} sequential):      median     p95")
    for k in ("bare_subprocess", "sandboxed"):
        print(f"  {k:<34} {s[k]['median_ms']:7.2f} ms {s[k]['p95_ms']:7.2f} ms")
    print("\ntool calls per second:")
    print(
        f"  {'tool':<20} {'concurrency':>11} {'calls':>6} {'calls/s':>8} "
        f"{'p50 ms':>8} {'p95 ms':>8}"
    )
    for r in res["throughput"]:
        print(
            f"  {r['tool']:<20} {r['concurrency']:>11} {r['calls']:>6} {r['calls_per_s']:>8} "
            f"{r['latency_median_ms']:>8} {r['latency_p95_ms']:>8}"
            + (f"  FAILURES {r['failures']}" if r["failures"] else "")
        )
    res["host"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "machine": platform.machine(),
    }
    res["args"] = vars(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sandbox.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'sandbox.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
