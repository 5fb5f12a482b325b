"""The live display's per-task rows: rendered from constructed snapshots, and fed by a real
replay batch in the real sandbox (run under the sandbox lock)."""

from __future__ import annotations

import asyncio
import io
import json

from rich.console import Console

from runner.batch.batch import Batch, BatchConfig
from runner.batch.progress import ROWS_MAX, BatchStatus, TaskRow, render_live
from runner.engines.replay import ReplayEngine
from runner.policies.baselines import NoGate
from runner.runfolder.store import RunStore
from runner.sim.tools import NullSandbox
from runner.tasks.tasks import Task
from tools.sandbox import BwrapSandbox


def text(renderable) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def status(rows=()) -> BatchStatus:
    return BatchStatus(3, 5, 1, 1, 0, 2, 17, 1234, 0.5, 0.25, 0.75, 50, rows=tuple(rows))


def test_rows_render_under_the_summary_line():
    rows = [
        TaskRow("swe-001", "in tool", 3, 10, 2345, 120, "bash", 12.4),
        TaskRow("swe-002", "paused", 5, 10, 4100, 300, "str_replace_editor", 30.0),
        TaskRow("swe-003", "pending", 0, 16, 0, 0, None, 1.0),
        TaskRow("swe-004", "done submitted", 4, 10, 3000, 200, "submit", 41.6),
    ]
    lines = text(render_live(status(rows), 10.0)).splitlines()
    assert lines[0].startswith("agents 3/5 | W 2 active 1 paused 1 pending 0 | steps 17")
    assert lines[1].split() == [
        "task",
        "state",
        "step",
        "context",
        "gen",
        "tok",
        "last",
        "tool",
        "seconds",
    ]
    cells = [line.split() for line in lines[2:]]
    assert cells[0] == ["swe-001", "in", "tool", "3/10", "2,345", "120", "bash", "12"]
    assert cells[1] == ["swe-002", "paused", "5/10", "4,100", "300", "str_replace_editor", "30"]
    assert cells[2] == ["swe-003", "pending", "0/16", "0", "0", "-", "1"]
    assert cells[3] == ["swe-004", "done", "submitted", "4/10", "3,000", "200", "submit", "42"]


def test_without_rows_the_display_is_the_line():
    assert text(render_live(status(), 10.0)).strip().splitlines() == [
        text(render_live(status(), 10.0)).strip()
    ]


def call(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_large_batches_get_no_rows(tmp_path):
    tasks = [Task(f"t{i}", [{"role": "user", "content": "hi"}]) for i in range(ROWS_MAX + 1)]
    engine = ReplayEngine({t.id: [] for t in tasks})
    batch = Batch(tasks, engine, NullSandbox(), NoGate(), RunStore(tmp_path / "r"), BatchConfig())
    assert batch.status().rows == ()
    small = Batch(
        tasks[:3], engine, NullSandbox(), NoGate(), RunStore(tmp_path / "s"), BatchConfig()
    )
    assert [(r.task_id, r.state, r.step) for r in small.status().rows] == [
        ("t0", "pending", 0),
        ("t1", "pending", 0),
        ("t2", "pending", 0),
    ]


async def test_a_real_replay_batch_feeds_the_rows(tmp_path, needs_bwrap):
    script = [call("bash", command="sleep 1; echo hi"), call("submit", answer="ok")]
    tasks = [Task(f"t{i}", [{"role": "user", "content": "go"}], max_steps=5) for i in range(3)]
    engine = ReplayEngine({t.id: list(script) for t in tasks})
    store = RunStore(tmp_path / "run")
    batch = Batch(tasks, engine, BwrapSandbox(), NoGate(), store, BatchConfig(control_period=0.1))
    seen: list[BatchStatus] = []

    async def main() -> None:
        run = asyncio.create_task(batch.run())
        while not run.done():
            seen.append(batch.status())
            await asyncio.sleep(0.05)
        await run
        seen.append(batch.status())

    await main()
    states = {r.state for s in seen for r in s.rows}
    assert {"pending", "in tool", "done submitted"} <= states, states
    in_tool = [r for s in seen for r in s.rows if r.state == "in tool"]
    # the bash call (step 1), and submit's patch capture (step 2), are tools
    assert {(r.step, r.last_tool) for r in in_tool} <= {(1, "bash"), (2, "submit")}
    assert (1, "bash") in {(r.step, r.last_tool) for r in in_tool}
    assert all(r.context_tokens > 0 for r in in_tool)
    final = seen[-1].rows
    assert [(r.task_id, r.state, r.step, r.max_steps, r.last_tool) for r in final] == [
        (f"t{i}", "done submitted", 2, 5, "submit") for i in range(3)
    ]
    assert all(r.seconds >= 1.0 for r in final)  # each slept a second in its tool
    shown = text(render_live(seen[len(seen) // 2], 1.0))
    assert all(f"t{i}" in shown for i in range(3))
