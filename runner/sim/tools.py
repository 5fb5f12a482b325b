"""`sim_tool`: the tool of simulated workloads. It takes the time a real tool took and
returns an observation of the size a real tool returned (a token span, see
runner/engines/chatml_tokenizer.py). On the simulator's virtual clock the wait costs no wall time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tools.core import Observation, Tool, ToolContext
from tools.submit import Submit

from ..engines.chatml_tokenizer import span


@dataclass
class SimTool:
    name: str = "sim_tool"
    description: str = "Run the next action of the simulated task."
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {
                "seconds": {"type": "number", "description": "How long the tool runs."},
                "tokens": {"type": "integer", "description": "Size of its output, tokens."},
                "seed": {"type": "integer", "description": "Identity of the output tokens."},
            },
            "required": ["seconds", "tokens", "seed"],
        }
    )

    async def __call__(self, args: dict[str, Any], ctx: ToolContext) -> Observation:
        seconds, tokens, seed = float(args["seconds"]), int(args["tokens"]), int(args["seed"])
        if seconds < 0 or tokens < 0 or seed < 1:
            return Observation("sim_tool: seconds and tokens must be >= 0, seed >= 1", ok=False)
        await asyncio.sleep(seconds)
        return Observation(span(tokens, seed))


class NullSandbox:
    """The sandbox of simulated runs: simulated tools run no commands, so it refuses any."""

    mode = "none (simulation)"

    def prepare_workspace(self, workspace: Any, uid: int) -> None:
        return None

    def workdir(self, workspace: Any) -> str:
        return str(workspace)

    async def run(self, command: str, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the simulator runs no commands (asked to run {command!r})")

    async def aclose(self) -> None:
        return None


# The tools of simulated runs. The production registry (tools/registry.py) does not know them: a
# real task that names `sim_tool` gets "unknown tool" like any other name.
SIM_TOOLS: dict[str, Callable[[], Tool]] = {"sim_tool": SimTool, "submit": Submit}
