"""`bash`: run a shell command in the agent's workspace, in its sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .core import (
    Observation,
    ToolContext,
    limits_with_timeout,
    result_observation,
    timed_parameters,
)


@dataclass
class Bash:
    name: str = "bash"
    description: str = (
        "Run a bash command in the task's workspace (the current directory) and return its "
        "output and exit code. No network. Use it to inspect files, edit them (e.g. with "
        "sed or a python3 one-liner) and run tests."
    )
    parameters: dict[str, Any] = field(
        default_factory=lambda: timed_parameters("command", "The command to run.")
    )
    max_timeout: float = 600.0

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        limits = limits_with_timeout(self.name, args, ctx, self.max_timeout)
        if isinstance(limits, Observation):
            return limits
        try:
            r = await ctx.sandbox.run(args["command"], ctx.workspace, ctx.uid, limits)
        except OSError as e:  # e.g. the host is out of processes: tell the model
            return Observation(f"bash: could not start the command: {e}", ok=False)
        return result_observation(r, limits)
