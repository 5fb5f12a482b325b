"""`submit`: end the agent, with its answer and, in a git workspace, its patch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .core import Observation, ToolContext
from .gitrepo import capture_patch


@dataclass
class Submit:
    name: str = "submit"
    description: str = "Finish the task. Call it once the work is done, with a short summary."
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "Summary or final answer."}},
            "required": [],
        }
    )

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        answer = str(args.get("answer", ""))
        text = "Submitted."
        if ctx.state.get("git_base"):  # a git workspace: the patch is part of the result
            patch = await capture_patch(ctx)
            ctx.state["patch"] = patch
            text += f" {patch['summary']}"
        return Observation(text, submitted=True, answer=answer)
