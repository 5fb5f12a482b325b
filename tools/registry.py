"""The production tools by name. Simulated runs pass their own registry to get_tools
(runner/sim/tools.py), so a real run never sees a simulated tool."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .bash import Bash
from .core import Tool
from .editor import StrReplaceEditor
from .python_tool import Python
from .submit import Submit

REGISTRY: dict[str, Callable[[], Tool]] = {
    "bash": Bash,
    "python": Python,
    "str_replace_editor": StrReplaceEditor,
    "submit": Submit,
}
DEFAULT_TOOLS = ("bash", "python", "str_replace_editor", "submit")


def get_tools(
    names: list[str] | tuple[str, ...], registry: Mapping[str, Callable[[], Tool]] | None = None
) -> dict[str, Tool]:
    """Fresh tools by name from `registry` (default: the production tools). `submit` is
    always added."""
    registry = REGISTRY if registry is None else registry
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; available: {sorted(registry)}")
    tools = {n: registry[n]() for n in names}
    if "submit" not in tools:
        tools["submit"] = Submit()  # an agent must always be able to end
    return tools
