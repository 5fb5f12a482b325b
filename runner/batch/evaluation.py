"""Evaluating a task: its `eval` command, or its SWE-bench tests, in a fresh sandbox over the
workspace as the agent left it."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.sandbox import CommandSandbox, Limits

from ..tasks.swebench import evaluate_swe
from ..tasks.tasks import Task


async def evaluate(
    sandbox: CommandSandbox, task: Task, workspace: Path, uid: int, limits: Limits, timeout: float
) -> dict[str, Any] | None:
    """Run the task's `eval` command (or its SWE-bench tests) in a fresh sandbox over the
    workspace as it is now. None when the task has no eval (or the workspace is gone)."""
    swe = task.swe if task.swe is not None and task.swe.evaluates else None
    if not (task.eval or swe) or not workspace.exists():
        return None
    limits = Limits(**{**asdict(limits), "timeout_s": timeout})
    if swe is not None:
        try:
            return await evaluate_swe(sandbox, swe, workspace, uid, limits)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # as below: a record, never the batch's end
            return {"command": swe.test_cmd, "solved": False, "error": f"{type(e).__name__}: {e}"}
    assert task.eval is not None
    try:
        r = await sandbox.run(task.eval, workspace, uid, limits)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the sandbox failed, or the command cannot be run: a record
        return {"command": task.eval, "solved": False, "error": f"{type(e).__name__}: {e}"}
    return {
        "command": task.eval,
        "exit_code": r.exit_code,
        "solved": r.exit_code == 0 and not r.timed_out,
        "timed_out": r.timed_out,
        "seconds": round(r.seconds, 3),
        "output_tail": r.output[-2000:],
    }
