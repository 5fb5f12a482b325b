"""Rewards, per-sample seeds and pass@k.

A trajectory's reward is a float: the task's `reward` command's last output line when the
task sets one (a graded score), else 1.0 when `eval` exited 0 and 0.0 when it did not, else
None (no eval). A reward command that fails or prints no float is an error on that record
(`reward_error`), never the batch's end.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import asdict
from typing import Any

from tools.core import ToolContext
from tools.sandbox import CommandSandbox, Limits

from ..runfolder.records import eval_reward
from .tasks import Task

OUTPUT_TAIL = 2000  # characters of the reward command's output kept in the record


def sample_seed(seed: int, k: int) -> int:
    """The sampling seed of sample k: --seed itself for k = 0 (a single-sample run is
    unchanged), else a hash of (seed, k), so no two (seed, k) pairs share a stream."""
    if k == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def eval_reward_fields(ev: dict[str, Any]) -> dict[str, Any]:
    """The reward fields of a task without a reward command: the reward follows its eval."""
    reward = eval_reward(ev)
    return {
        "reward": reward,
        "reward_source": None if reward is None else "eval",
        "reward_error": None,
        "reward_output": None,
    }


async def reward_fields(
    sandbox: CommandSandbox, task: Task, ctx: ToolContext, ev: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """reward, reward_source, reward_error, reward_output for a finished agent."""
    if not task.reward:
        return eval_reward_fields(ev)
    out: dict[str, Any] = {"reward": None, "reward_source": "command", "reward_output": None}
    if not ctx.workspace.exists():
        return {**out, "reward_error": "the workspace is gone: the reward command cannot run"}
    limits = Limits(**{**asdict(ctx.limits), "timeout_s": timeout})
    try:
        r = await sandbox.run(task.reward, ctx.workspace, ctx.uid, limits)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the sandbox failed: an error on this record
        return {**out, "reward_error": f"reward command could not run: {type(e).__name__}: {e}"}
    out["reward_output"] = r.output[-OUTPUT_TAIL:]
    reward, error = parse_reward(r.output, r.exit_code, r.timed_out)
    return {**out, "reward": reward, "reward_error": error}


def parse_reward(
    output: str, exit_code: int | None, timed_out: bool
) -> tuple[float | None, str | None]:
    """-> (reward, None) or (None, why not)."""
    if timed_out:
        return None, "reward command timed out"
    if exit_code != 0:
        return None, f"reward command exited {exit_code}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return None, "reward command printed nothing (its last line must be a float)"
    try:
        value = float(lines[-1])
    except ValueError:
        return None, f"reward command's last line is not a float: {lines[-1][:200]!r}"
    if not math.isfinite(value):
        return None, f"reward command's last line is not a finite float: {lines[-1]!r}"
    return value, None
