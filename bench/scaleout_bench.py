"""A batch over 1, 2 and 4 Ray workers, side by side in one run, on a workload whose time is
tool waits (the replay engine; each step's tool sleeps), so two cores suffice.

    python -m bench.scaleout_bench [--tasks 160] [--steps 4] [--sleep 0.25] [--cap 8]

A real local Ray cluster of two nodes (two CPUs each, on 127.0.0.1) runs every configuration;
a single-process batch of the same tasks is the reference. Prints and writes
bench/results/scaleout/scaleout.json: per configuration the batch span (first task handed out
to last record written), throughput and its ratio to one worker, and the driver's overhead per
record (its own work on each record: checks, writes, fsyncs; and its whole process CPU time).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ray reads it on import: every node and driver of this bench binds and connects on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from bench.common.paths import SCALEOUT_RESULTS
from runner.batch.batch import Batch, BatchConfig
from runner.engines.replay import ReplayEngine, scripts_from_tasks
from runner.policies.baselines import AgentCap
from runner.runfolder.store import RunStore
from runner.scaleout import driver
from runner.scaleout.protocol import EngineBuild, WorkerSpec, worker_uid_base
from runner.sim.tools import NullSandbox
from runner.tasks.tasks import Task
from tools.core import Observation, Tool, ToolContext
from tools.submit import Submit

RESULTS = SCALEOUT_RESULTS


@dataclass
class Sleep:
    """The bench's tool: a wait, as a long test run or a build would be (no process: two
    cores stay free for the runners)."""

    name: str = "sleep"
    description: str = "Wait for the given seconds."
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {"seconds": {"type": "number"}},
            "required": ["seconds"],
        }
    )

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        await asyncio.sleep(float(args["seconds"]))
        return Observation("done waiting")


TOOLS: dict[str, Callable[[], Tool]] = {"sleep": Sleep, "submit": Submit}


def make_tasks(n: int, steps: int, seconds: float) -> list[Task]:
    call = json.dumps({"name": "sleep", "arguments": {"seconds": seconds}})
    return [
        Task(
            f"b{i:04d}",
            [{"role": "user", "content": f"task {i}: wait, then submit"}],
            tools=["sleep", "submit"],
            raw={"replay": [f"<tool_call>{call}</tool_call>"] * steps},
        )
        for i in range(n)
    ]


def config(workspace_root: Path | None = None, uid_base: int | None = None) -> BatchConfig:
    c = BatchConfig(max_steps=64, tools=("sleep", "submit"), tool_registry=TOOLS, git_base=False)
    c.workspace_root = workspace_root
    if uid_base is not None:
        c.uid_base = uid_base
    return c


def replay_engine() -> EngineBuild:
    return EngineBuild(ReplayEngine({}), "bench: replay, scripts from the tasks")


def spec(cap: int, root: Path, index: int) -> WorkerSpec:
    return WorkerSpec(
        index=index,
        config=config(root / f"ws-{index}", worker_uid_base(200000, index)),
        policy=AgentCap(cap),
        make_engine=replay_engine,
        make_sandbox=NullSandbox,
    )


def single_process(tasks: list[Task], cap: int, out: Path) -> dict[str, Any]:
    store = RunStore(out)
    engine = ReplayEngine(scripts_from_tasks(tasks))
    batch = Batch(tasks, engine, NullSandbox(), AgentCap(cap), store, config())
    t0 = time.monotonic()
    asyncio.run(batch.run())
    span = time.monotonic() - t0
    assert len(store.finished) == len(tasks)
    return {"workers": "single process (no Ray)", "span_s": round(span, 3),
            "tasks_per_s": round(len(tasks) / span, 3)}  # fmt: skip


def on_ray(address: str, tasks: list[Task], workers: int, cap: int, out: Path) -> dict[str, Any]:
    store = RunStore(out)
    outcome = driver.run(
        address=address,
        store=store,
        tasks=tasks,
        make_spec=functools.partial(spec, cap, out),
        workers=workers,
        gpus_per_worker=0,
        progress=None,
        task_ids=[t.id for t in tasks],
        invalid_records=0,
        config={"bench": "scaleout"},
    )
    s = outcome.summary
    assert outcome.exit_code == 0 and s["unfinished"] == 0, s
    ids = [json.loads(x)["task_id"] for x in store.trajectories.read_text().splitlines()]
    assert sorted(ids) == sorted(t.id for t in tasks)  # each exactly once
    f = s["scaleout"]
    span = f["seconds_first_task_to_last_record"]
    return {
        "workers": workers,
        "nodes": len({w["node_id"] for w in s["workers"]}),
        "span_s": span,
        "wall_s": s["wall_seconds"],
        "tasks_per_s": round(len(tasks) / span, 3),
        "driver_ms_per_record": round(1000 * f["driver_seconds_per_record"], 3),
        "driver_handling_cpu_ms_per_record": round(
            1000 * f["driver_cpu_seconds_per_record_handled"], 3
        ),
        "driver_process_cpu_ms_per_record": round(1000 * f["driver_cpu_seconds_per_record"], 3),
        "records_per_worker": [w["records_kept"] for w in s["workers"]],
    }


def fsync_ms(where: Path, n: int = 200) -> float:
    """What one append + fsync costs on the run folders' disk (a durable record's floor)."""
    with tempfile.NamedTemporaryFile(dir=where) as f:
        t0 = time.perf_counter()
        for _ in range(n):
            f.write(b"x" * 200 + b"\n")
            f.flush()
            os.fsync(f.fileno())
        return round(1000 * (time.perf_counter() - t0) / n, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=160)
    ap.add_argument("--steps", type=int, default=4, help="tool calls per task")
    ap.add_argument("--sleep", type=float, default=0.25, help="seconds per tool call")
    ap.add_argument("--cap", type=int, default=8, help="agents per worker (agent-cap:N)")
    args = ap.parse_args()
    tasks = make_tasks(args.tasks, args.steps, args.sleep)

    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    )
    rows: list[dict[str, Any]] = []
    try:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        with tempfile.TemporaryDirectory(prefix="scaleout-bench-") as tmp:
            rows.append(single_process(tasks, args.cap, Path(tmp) / "single"))
            for n in (1, 2, 4):
                rows.append(on_ray(cluster.address, tasks, n, args.cap, Path(tmp) / f"w{n}"))
                print(rows[-1], flush=True)
    finally:
        cluster.shutdown()
    one = next(r for r in rows if r["workers"] == 1)["tasks_per_s"]
    for r in rows:
        r["ratio_vs_1_worker"] = round(r["tasks_per_s"] / one, 3)
    result = {
        "fsync_ms_on_run_folder_disk": fsync_ms(Path(tempfile.gettempdir())),
        "workload": {
            "tasks": args.tasks,
            "tool_calls_per_task": args.steps,
            "seconds_per_tool_call": args.sleep,
            "policy": f"agent-cap:{args.cap} per worker",
            "engine": "replay",
        },
        "rows": rows,
        "targets": {"ratio_2_workers": 1.8, "ratio_4_workers": 3.2, "driver_ms_per_record": 1.0},
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    print(f"{'workers':>26} {'span s':>7} {'tasks/s':>8} {'ratio':>6} {'drv ms/rec':>10} "
          f"{'its cpu':>8} {'process cpu':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['workers']!s:>26} {r['span_s']:>7.2f} {r['tasks_per_s']:>8.2f} "
            f"{r['ratio_vs_1_worker']:>6.2f} {r.get('driver_ms_per_record', '-')!s:>10} "
            f"{r.get('driver_handling_cpu_ms_per_record', '-')!s:>8} "
            f"{r.get('driver_process_cpu_ms_per_record', '-')!s:>11}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scaleout.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'scaleout.json'}")


if __name__ == "__main__":
    main()
