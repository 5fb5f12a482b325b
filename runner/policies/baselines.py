"""The baselines: no gate at all, a fixed cap on agents, a fixed cap on requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .protocol import Decision, PauseRule, ResumeRule, Signals, Unit


@dataclass(frozen=True)
class NoGate:
    """No admission control: every agent active at once (the uncontrolled engine)."""

    name: ClassVar[str] = "none"
    rules: ClassVar[tuple[PauseRule, ResumeRule]] = ("newest", "oldest")
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

    def initial_window(self, n_agents: int) -> int:
        return max(1, n_agents)

    def update(self, s: Signals) -> Decision:
        return Decision(max(1, s.unfinished), "fixed")

    def params(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class AgentCap:
    """A fixed number of agents hold slots (the paper's fixed-cap baseline)."""

    n: int
    name: ClassVar[str] = "agent-cap"
    rules: ClassVar[tuple[PauseRule, ResumeRule]] = ("newest", "oldest")
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"{self.name}:N needs N >= 1, got {self.n}")

    def initial_window(self, n_agents: int) -> int:
        return self.n

    def update(self, s: Signals) -> Decision:
        return Decision(self.n, "fixed")

    def params(self) -> dict[str, Any]:
        return {"n": self.n}


@dataclass(frozen=True)
class RequestCap(AgentCap):
    """At most N generation requests in flight; an agent in a tool call holds nothing
    (the paper's request-level baseline)."""

    name: ClassVar[str] = "request-cap"
    unit: ClassVar[Unit] = "request"
