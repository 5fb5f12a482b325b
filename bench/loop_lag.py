"""Event-loop lag while 1,000 agents finish at once: `python -m bench.loop_lag [--agents 1000]`.

Each agent writes what a finished agent writes (its rollouts.jsonl line, then its
trajectory line, each one write() and fsync'd) into a fresh run folder on a real disk, all
1,000 released at the same instant, while a probe on the loop sleeps 1 ms at a time and
records how late it wakes up (the lag every agent, the gate and the controller would see).
Three ways, side by side in one run, alternating over --rounds:

- on the loop (before): RunStore's synchronous writes (`append_records`, `add_trajectories`,
  as the Ray driver's writer thread uses them) called from the agent's task: one line each,
  one fsync each, what the batch did until the writer thread;
- aiofiles: each line through `aiofiles.open` (open, write, fsync, close: each a hop to the
  loop's default thread pool);
- writer thread (now): `RunStore.finish`, what the batch calls: the same synchronous writes,
  run on the store's one writer thread.

Prints the worst lag and the p99 of the probe's lags, and how long until every agent was
recorded; writes bench/results/loop-lag/loop_lag.json. The folder must be on a real disk
(fsync on tmpfs costs nothing): --dir, default the system temp dir (refused if it is a tmpfs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from bench.common.paths import LOOP_LAG_RESULTS
from runner.runfolder.records import rollout_record, trajectory
from runner.runfolder.store import FORMAT_VERSION, RunStore

PROBE_S = 0.001
PROMPT_TOKENS, RESPONSE_TOKENS = 1000, 1000  # one agent's rollout: 2,000 tokens
VOCAB = 49152

Write = Callable[[RunStore, dict[str, Any], dict[str, Any]], Awaitable[None]]


def records(n: int, seed: int = 0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(trajectory, rollout) of n finished agents."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = trajectory(task_id=f"t{i}", task=f"t{i}", sample=0, seed=0, engine="x", model="m")
        t.update(status="submitted", steps=8, answer="done", reason="submitted")
        ids = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS + RESPONSE_TOKENS)]
        spans = [(PROMPT_TOKENS, PROMPT_TOKENS + RESPONSE_TOKENS, PROMPT_TOKENS + RESPONSE_TOKENS)]
        lps = [-rng.random() for _ in range(len(ids))]
        out.append((t, rollout_record(t, ids, PROMPT_TOKENS, spans, lps)))
    return out


async def on_loop(store: RunStore, traj: dict[str, Any], rollout: dict[str, Any]) -> None:
    store.append_records("rollouts.jsonl", [rollout])
    store.add_trajectories([traj])


_fsync = aiofiles.os.wrap(os.fsync)


async def _aiofiles_line(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode()
    async with aiofiles.open(path, "ab", buffering=0) as f:
        await f.write(line)
        await _fsync(f.fileno())


async def with_aiofiles(store: RunStore, traj: dict[str, Any], rollout: dict[str, Any]) -> None:
    await _aiofiles_line(store.rollouts, rollout)
    await _aiofiles_line(store.trajectories, {"format": FORMAT_VERSION, **traj})


async def writer_thread(store: RunStore, traj: dict[str, Any], rollout: dict[str, Any]) -> None:
    await store.finish(traj, {"rollouts.jsonl": rollout})


WAYS: dict[str, Write] = {
    "on the loop (before)": on_loop,
    "aiofiles": with_aiofiles,
    "writer thread (now)": writer_thread,
}


async def one_round(
    write: Write, store: RunStore, recs: list[tuple[dict[str, Any], dict[str, Any]]]
) -> tuple[list[float], float]:
    """-> the probe's lags (s) from the release until every agent is recorded, and that time."""
    loop = asyncio.get_running_loop()
    go = asyncio.Event()
    lags: list[float] = []
    done = False

    async def probe() -> None:
        while not done:
            t = loop.time()
            await asyncio.sleep(PROBE_S)
            lags.append(max(0.0, loop.time() - t - PROBE_S))

    async def agent(traj: dict[str, Any], rollout: dict[str, Any]) -> None:
        await go.wait()
        await write(store, traj, rollout)

    agents = [asyncio.create_task(agent(t, r)) for t, r in recs]
    await asyncio.sleep(0.05)  # every agent waiting on the release
    p = asyncio.create_task(probe())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    go.set()
    await asyncio.gather(*agents)
    seconds = time.perf_counter() - t0
    done = True
    await p
    return lags, seconds


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, typ, *_ = line.split()
            if str(path).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, typ
    return kind


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the run folders go")
    ap.add_argument("--out", type=Path, default=LOOP_LAG_RESULTS / "loop_lag.json")
    args = ap.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="loop-lag-", dir=args.dir))
    kind = fs_type(work.resolve())
    if kind in ("tmpfs", "ramfs"):
        sys.exit(f"{work} is on {kind}: fsync costs nothing there; pass --dir on a real disk")
    recs = records(args.agents)
    line_kb = [
        len(json.dumps(r)) / 1024 for r in (recs[0][1], {"format": FORMAT_VERSION, **recs[0][0]})
    ]
    print(
        f"{args.agents} agents finishing at once, {args.rounds} rounds, in {work} ({kind}); "
        f"lines: rollout {line_kb[0]:.0f} KiB, trajectory {line_kb[1]:.1f} KiB, each fsync'd"
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in WAYS}
    try:
        for r in range(args.rounds):
            for name, write in WAYS.items():
                folder = work / f"{r}-{name.split()[0]}"
                store = RunStore(folder)
                lags, seconds = asyncio.run(one_round(write, store, recs))
                ids = [json.loads(x)["task_id"] for x in store.trajectories.open()]
                assert sorted(ids) == sorted(t["task_id"] for t, _ in recs), name
                runs[name].append({"lags": lags, "seconds": seconds})
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {}
    print(f"{'':24}{'worst lag':>12}{'p99 lag':>12}{'all recorded':>15}{'probe wakes':>13}")
    for name, rs in runs.items():
        lags = [x for run in rs for x in run["lags"]]
        rows[name] = {
            "worst_lag_ms": round(max(lags) * 1000, 2),
            "p99_lag_ms": round(p99(lags) * 1000, 2),
            "worst_lag_ms_per_round": [round(max(run["lags"]) * 1000, 2) for run in rs],
            "all_recorded_s_per_round": [round(run["seconds"], 3) for run in rs],
            "all_recorded_s_median": round(statistics.median(run["seconds"] for run in rs), 3),
            "probe_wakes": len(lags),
        }
        row = rows[name]
        print(
            f"{name:24}{row['worst_lag_ms']:>10.1f}ms{row['p99_lag_ms']:>10.1f}ms"
            f"{row['all_recorded_s_median']:>14.2f}s{len(lags):>13}"
        )
    before, now = rows["on the loop (before)"], rows["writer thread (now)"]
    ratio = before["worst_lag_ms"] / max(now["worst_lag_ms"], 1e-3)
    slower = now["all_recorded_s_median"] / before["all_recorded_s_median"]
    print(f"worst lag {ratio:.0f}x lower on the writer thread; time to record all: x{slower:.2f}")
    result = {
        "agents": args.agents,
        "rounds": args.rounds,
        "filesystem": kind,
        "line_kib": {"rollout": round(line_kb[0], 1), "trajectory": round(line_kb[1], 1)},
        "fsyncs_per_agent": 2,
        "probe_period_ms": PROBE_S * 1000,
        "cpus": os.cpu_count(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),  # other work on the machine
        "python": sys.version.split()[0],
        "ways": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
