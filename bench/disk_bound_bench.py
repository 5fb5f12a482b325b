"""What the exact workspace size bound costs, side by side for each kind of workspace
filesystem (tools/sandbox/workspaces.py): "tmpfs" and "ext4" (a loop-mounted sparse image),
exact, against "watch" (a plain directory whose size is checked while commands run).

For each kind, in one run:
- setup: make_workspace + prepare_workspace (what a batch adds per agent), and removal;
- a sandboxed `true` in an empty workspace and in one of 5,000 small files (the watch walks
  the tree after every command; an exact bound reads statvfs), the kinds taking turns;
- write and read throughput inside the sandbox (dd, 1 MiB blocks, the written file read back
  from the page cache), write with fdatasync: medians of 5 rounds, the kinds taking turns;
- the bound itself: `dd` of 1 GiB and `fallocate -l 1G` against the limit, the usage they
  reached (from the filesystem for exact kinds, from a du-like walk for the watch);
- RAM held by a full workspace (Shmem in /proc/meminfo, the page cache of the image).

    python -m bench.disk_bound_bench [--workspaces 30] [--limit-mib 256] [--reps 40] [--rounds 5]

Needs root, bubblewrap and e2fsprogs; run it under the sandbox lock (`flock
/tmp/concur-sandbox.lock`): its uids (251000+) are in a uid block no run leases, so another
run's start-up sweep would kill its commands. Prints a table and writes
bench/results/disk-bound/disk_bound.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.paths import DISK_BOUND_RESULTS
from tools.sandbox import (
    FS_KINDS,
    BwrapSandbox,
    ExecResult,
    Limits,
    make_workspace,
    remove_tree,
)
from tools.sandbox.filesystem import disk_usage
from tools.sandbox.workspaces import space, workspace_bound

RESULTS = DISK_BOUND_RESULTS
UID0 = 251000  # clear of the batch (200000+), test (210000-239999) and sandbox bench uids
MiB = 2**20


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 2)


def meminfo(key: str) -> int:
    text = Path("/proc/meminfo").read_text()
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def usage(ws: Path, limit: int) -> int:
    bound = workspace_bound(ws)
    if bound is not None:
        return space(ws, bound)[0]
    return disk_usage(ws, 8 * limit)


def dd_rate(output: str) -> float:
    """MiB/s from dd's last line ("... bytes (...) copied, S s, ..."): bytes / seconds."""
    m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", output, re.MULTILINE)
    return round(int(m.group(1)) / float(m.group(2)) / MiB, 1) if m else float("nan")


class Bench:
    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit
        self.sb = BwrapSandbox()
        self.lim = Limits(workspace_bytes=limit, fsize_bytes=4 * 2**30, timeout_s=60)
        self.uid = UID0

    def new(self, fs: str, name: str) -> tuple[Path, int]:
        self.uid += 1
        ws = self.root / f"{fs}-{name}"
        make_workspace(ws, self.limit, fs)
        self.sb.prepare_workspace(ws, self.uid)
        return ws, self.uid

    async def run(self, cmd: str, ws: Path, uid: int) -> tuple[float, ExecResult]:
        t = time.perf_counter()
        r = await self.sb.run(cmd, ws, uid, self.lim)
        return time.perf_counter() - t, r

    async def setup_cost(self, fs: str, n: int) -> dict[str, float]:
        made, removed = [], []
        for i in range(n):
            t = time.perf_counter()
            ws, _ = self.new(fs, f"setup{i}")
            made.append(time.perf_counter() - t)
            t = time.perf_counter()
            remove_tree(ws)
            removed.append(time.perf_counter() - t)
        return {"setup_median_ms": median_ms(made), "remove_median_ms": median_ms(removed)}

    async def command_costs(self, kinds: list[str], files: int, reps: int) -> dict[str, float]:
        """Median time of a sandboxed `true` per kind, the kinds taking turns (so that the
        load of this shared machine falls on each alike)."""
        spaces = {fs: self.new(fs, f"files{files}") for fs in kinds}
        for ws, uid in spaces.values():
            if files:
                await self.run(f"mkdir d && cd d && seq {files} | xargs touch", ws, uid)
        times: dict[str, list[float]] = {fs: [] for fs in kinds}
        for _ in range(reps):
            for fs, (ws, uid) in spaces.items():
                times[fs].append((await self.run("true", ws, uid))[0])
        for ws, _ in spaces.values():
            remove_tree(ws)
        return {fs: median_ms(t) for fs, t in times.items()}

    async def throughputs(self, kinds: list[str], rounds: int) -> dict[str, dict[str, float]]:
        """Median dd rates per kind over `rounds`, the kinds taking turns."""
        mib = min(200, self.limit // MiB // 2)
        cmds = {
            "write_MiBps": f"dd if=/dev/zero of=f bs=1M count={mib} 2>&1",
            "read_MiBps": "dd if=f of=/dev/null bs=1M 2>&1",
            "write_sync_MiBps": f"rm f; dd if=/dev/zero of=g bs=1M count={mib} conv=fdatasync 2>&1",
        }
        rates: dict[str, dict[str, list[float]]] = {fs: {k: [] for k in cmds} for fs in kinds}
        for _ in range(rounds):
            for fs in kinds:
                ws, uid = self.new(fs, "io")
                for key, cmd in cmds.items():
                    rates[fs][key].append(dd_rate((await self.run(cmd, ws, uid))[1].output))
                remove_tree(ws)
        return {
            fs: {k: round(statistics.median(v), 1) for k, v in by.items()}
            for fs, by in rates.items()
        }

    async def bound(self, fs: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for what, cmd in (
            ("dd_1GiB", "dd if=/dev/zero of=big bs=1M count=1024 2>&1"),
            ("fallocate_1GiB", "fallocate -l 1G big 2>&1"),
        ):
            ws, uid = self.new(fs, what)
            shmem, cached = meminfo("Shmem"), meminfo("Cached")
            _, r = await self.run(cmd, ws, uid)
            own = r.output[: len(r.output) - len(r.notes)]  # without the sandbox's notes
            used = usage(ws, self.limit)
            out[what] = {
                "used_MiB": round(used / MiB, 1),
                "over_limit_MiB": round(max(0, used - self.limit) / MiB, 1),
                "enospc": "No space left on device" in own,
                "killed_by_watch": r.killed == "workspace",
                "note": r.notes.strip(),
                "shmem_delta_MiB": round((meminfo("Shmem") - shmem) / MiB, 1),
                "page_cache_delta_MiB": round((meminfo("Cached") - cached) / MiB, 1),
            }
            remove_tree(ws)
        return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="concur-diskbench-", dir="/tmp"))
    root.chmod(0o755)
    b = Bench(root, args.limit_mib * MiB)
    kinds: dict[str, Any] = {}
    try:
        for fs in FS_KINDS:
            made = make_workspace(root / f"probe-{fs}", b.limit, fs)
            remove_tree(root / f"probe-{fs}")
            kinds[fs] = {} if made.fs == fs else {"unavailable": made.why}
        ok = [fs for fs in FS_KINDS if not kinds[fs]]
        for files, key in ((0, "true_empty_ms"), (5000, "true_5000_files_ms")):
            for fs, ms in (await b.command_costs(ok, files, args.reps)).items():
                kinds[fs][key] = ms
        for fs, rates in (await b.throughputs(ok, args.rounds)).items():
            kinds[fs].update(rates)
        for fs in ok:
            kinds[fs].update(await b.setup_cost(fs, args.workspaces))
            kinds[fs].update(await b.bound(fs))
            print(fs, json.dumps(kinds[fs]), flush=True)
    finally:
        await b.sb.aclose()
        remove_tree(root)
    return {
        "limit_MiB": args.limit_mib,
        "workspaces_for_setup": args.workspaces,
        "true_reps": args.reps,
        "dd_rounds": args.rounds,
        "kinds": kinds,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "mem_GiB": round(meminfo("MemTotal") / 2**30, 1),
            "swap_GiB": round(meminfo("SwapTotal") / 2**30, 1),
        },
    }


def table(res: dict[str, Any]) -> str:
    rows = [
        ("setup (make + prepare), ms", "setup_median_ms"),
        ("remove, ms", "remove_median_ms"),
        ("`true`, empty workspace, ms", "true_empty_ms"),
        ("`true`, 5,000 files, ms", "true_5000_files_ms"),
        ("dd write, MiB/s", "write_MiBps"),
        ("dd write + fdatasync, MiB/s", "write_sync_MiBps"),
        ("dd read (cached), MiB/s", "read_MiBps"),
    ]
    kinds = [k for k, v in res["kinds"].items() if "unavailable" not in v]
    lines = ["| | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(str(res["kinds"][k][key]) for k in kinds) + " |")
    for what in ("dd_1GiB", "fallocate_1GiB"):
        cells = [
            f"{res['kinds'][k][what]['used_MiB']} MiB"
            + (" (ENOSPC)" if res["kinds"][k][what]["enospc"] else "")
            for k in kinds
        ]
        lines.append(f"| {what} vs {res['limit_MiB']} MiB: usage | " + " | ".join(cells) + " |")
    for label, key in (
        ("RAM (Shmem) held by the full workspace, MiB", "shmem_delta_MiB"),
        ("page cache (reclaimable) after filling it, MiB", "page_cache_delta_MiB"),
    ):
        cells = [str(res["kinds"][k]["dd_1GiB"][key]) for k in kinds]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspaces", type=int, default=30, help="workspaces made per kind")
    ap.add_argument("--limit-mib", type=int, default=256, help="the workspace size limit")
    ap.add_argument("--reps", type=int, default=40, help="sandboxed `true`s per kind and tree")
    ap.add_argument("--rounds", type=int, default=5, help="dd rounds per kind (median)")
    res = asyncio.run(main(ap.parse_args()))
    print(table(res))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "disk_bound.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {RESULTS / 'disk_bound.json'}")
