"""`run.py --eval-only`: score an existing run folder again, without running any agent.

It needs the final workspaces, i.e. a run made with --keep-workspaces (<run>/workspaces/).
Each finished task's `eval`, then its `reward` command, runs in a fresh sandbox over its
kept workspace; the `eval` and reward fields of its trajectory line are replaced (the file
is rewritten to a new file, then renamed over the old one), the rollout's reward follows,
and summary.json gets the new solved / evaluated counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.core import ToolContext
from tools.sandbox import CommandSandbox, lease_uids, move_tree, remove_tree

from ..runfolder.records import eval_field
from ..runfolder.store import RunStore, write_json_atomic
from ..runfolder.summary import record_totals
from ..tasks.rewards import eval_reward_fields, reward_fields
from ..tasks.tasks import Task
from .batch import BatchConfig
from .evaluation import evaluate

log = logging.getLogger("concur")
EVAL_CONCURRENCY = max(2, min(16, os.cpu_count() or 2))


class RescoreError(RuntimeError):
    """The run folder cannot be re-scored; the message says why and what to do."""


@dataclass
class Rescored:
    """One task scored again: its eval (None: it has none) and its reward fields (reward,
    reward_source, reward_error, reward_output), as the batch writes them."""

    eval: dict[str, Any] | None
    reward: dict[str, Any]


def rescore(
    tasks: list[Task], store: RunStore, sandbox: CommandSandbox, config: BatchConfig
) -> dict[str, Any]:
    """Re-run the evals; rewrite trajectories.jsonl and summary.json. -> the summary's
    `eval_only` section. RescoreError when there is nothing to score."""
    ws_dir = store.root / "workspaces"
    if not store.finished:
        raise RescoreError(f"{store.trajectories} has no finished agents: nothing to re-score")
    if not ws_dir.is_dir():
        raise RescoreError(
            f"--eval-only needs the final workspaces, but {ws_dir} does not exist: run the "
            "batch with --keep-workspaces to keep them"
        )
    by_id = {t.id: t for t in tasks}
    # only agents that ran: a task whose setup failed was never evaluated, nor is it now
    todo = [
        by_id[tid]
        for tid, rec in store.finished.items()
        if tid in by_id and (by_id[tid].eval or by_id[tid].reward) and "messages" in rec
    ]
    missing = [t.id for t in todo if not (ws_dir / t.id).is_dir()]
    for tid in missing:
        log.warning("task %s: no kept workspace in %s; its eval is left as it was", tid, ws_dir)
        store.add_error({"kind": "eval_only", "task_id": tid, "reason": "workspace not kept"})
    todo = [t for t in todo if t.id not in missing]
    t0 = time.monotonic()
    results = asyncio.run(_run_all(todo, ws_dir, sandbox, config))
    _rewrite(store, results)
    totals = record_totals(store.finished[t.id] for t in tasks if t.id in store.finished)
    section = {
        "time": time.time(),
        "seconds": round(time.monotonic() - t0, 3),
        "rescored": len(results),
        "solved_now": sum(1 for r in results.values() if r.eval and r.eval.get("solved")),
        "rewards_rerun": sum(1 for t in todo if t.reward),
        "missing_workspaces": missing,
        "tasks_without_eval": sum(1 for tid in store.finished if tid in by_id)
        - len(todo)
        - len(missing),
    }
    summary: dict[str, Any] = {}
    if store.summary.exists():
        try:
            summary = json.loads(store.summary.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            summary = {}
    summary.update(
        solved=totals["solved"],
        evaluated=totals["evaluated"],
        pass_at_k=totals["pass_at_k"],
        eval_only=section,
    )
    write_json_atomic(store.summary, summary)
    return {**section, "solved": summary["solved"], "evaluated": summary["evaluated"]}


async def _run_all(
    tasks: list[Task], ws_dir: Path, sandbox: CommandSandbox, config: BatchConfig
) -> dict[str, Rescored]:
    sem = asyncio.Semaphore(EVAL_CONCURRENCY)
    # A kept workspace may sit where the sandbox uids cannot reach it (e.g. under /root): then
    # it is moved into a 0755 temp dir for its eval, and back.
    tmp_root = Path(tempfile.mkdtemp(prefix="concur-eval-"))
    tmp_root.chmod(0o755)
    uids = lease_uids(len(tasks))  # the kernel frees them when this process ends

    async def one(i: int, task: Task) -> tuple[str, Rescored]:
        async with sem:
            try:
                return task.id, await _eval_one(task, ws_dir / task.id, uids.uid(i))
            except Exception as e:  # one bad workspace or command must not stop the others
                log.warning("task %s: eval failed: %s: %s", task.id, type(e).__name__, e)
                return task.id, _failed(task, f"{type(e).__name__}: {e}")

    async def _eval_one(task: Task, ws: Path, uid: int) -> Rescored:
        try:
            sandbox.prepare_workspace(ws, uid)
        except PermissionError:
            moved = tmp_root / task.id
            move_tree(ws, moved)
            try:
                sandbox.prepare_workspace(moved, uid)
                return await _score(task, moved, uid)
            finally:
                move_tree(moved, ws)
        return await _score(task, ws, uid)

    async def _score(task: Task, ws: Path, uid: int) -> Rescored:
        """As the batch scores a finished agent: its eval, then its reward command."""
        ev = await evaluate(sandbox, task, ws, uid, config.limits, config.eval_timeout)
        ctx = ToolContext(ws, uid, sandbox, config.limits)
        timeout = config.eval_timeout
        return Rescored(ev, await reward_fields(sandbox, task, ctx, eval_field(ev), timeout))

    try:
        done = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    finally:
        await sandbox.aclose()
        remove_tree(tmp_root)
    return dict(done)


def _failed(task: Task, error: str) -> Rescored:
    """A task whose re-scoring could not run: its eval fails with the error, and so does its
    reward command (an eval-derived reward follows the failed eval)."""
    ev = {"command": task.eval, "solved": False, "error": error} if task.eval else None
    if not task.reward:
        return Rescored(ev, eval_reward_fields(eval_field(ev)))
    out = {"reward": None, "reward_source": "command", "reward_output": None}
    return Rescored(ev, {**out, "reward_error": f"reward command could not run: {error}"})


def _rewrite(store: RunStore, results: dict[str, Rescored]) -> None:
    """Replace the `eval` and the reward fields of the re-scored records in
    trajectories.jsonl, and the reward and `solved` in rollouts.jsonl."""
    if not results:
        return
    now = time.time()
    changed: dict[str, dict[str, Any]] = {}

    def rescored(rec: dict[str, Any]) -> dict[str, Any]:
        if rec["task_id"] not in results:
            return rec
        res = results[rec["task_id"]]
        new = {**rec, "eval": eval_field(res.eval), **res.reward, "rescored_at": now}
        changed[rec["task_id"]] = new
        return new

    store.rewrite_trajectories(rescored)

    def rollout(rec: dict[str, Any]) -> dict[str, Any]:
        new = changed.get(rec.get("task_id", ""))
        if new is None:
            return rec
        return {**rec, "reward": new["reward"], "solved": new["eval"]["solved"]}

    store.rewrite_rollouts(rollout)
