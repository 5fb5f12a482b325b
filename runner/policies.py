"""Admission policies: small pure objects, signals in, window out.

Like a TCP congestion-control module, a policy never reads a clock, does no I/O and never
touches the gate: the gate decides WHEN (every control period, with a frozen `Signals`), the
policy decides HOW MUCH (a `Decision`). Adding a policy means writing one class here and
registering it; the gate and the agent loop do not change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Protocol

Unit = Literal["agent", "request"]


@dataclass(frozen=True)
class Signals:
    """What the gate knows at the end of one control period."""

    now: float
    window: int  # the current window W_t
    usage: float | None  # U_t: KV pool occupancy fraction; None if the engine cannot tell
    hit_rate: float | None  # H_t over requests finished this period; None if none finished
    active: int  # slot holders not marked paused
    paused: int  # paused agents (marked, or waiting to resume)
    pending: int  # agents never admitted yet
    finished: int
    unfinished: int  # everyone not finished: the upper bound of W
    requests: int  # requests finished this period
    peak_in_use: int  # most slot holders at once during the period


@dataclass(frozen=True)
class Decision:
    window: int
    branch: str  # why: "increase" | "decrease" | "hold" | "fixed" ...


class Policy(Protocol):
    name: str
    unit: Unit  # what a slot is held for: a whole agent life, or one request

    def initial_window(self, n_agents: int) -> int: ...

    def update(self, s: Signals) -> Decision: ...

    def params(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class AIMD:
    """The CONCUR law (paper, section 3):

    W+alpha if U < U_low; floor(W*beta) if U > U_high and H < H_thresh; otherwise hold.
    With no finished request in the period H is unknown and the decrease branch cannot fire:
    a cut needs evidence of thrashing, not the absence of measurements.
    """

    alpha: int = 2
    beta: float = 0.5
    u_low: float = 0.2
    u_high: float = 0.5
    h_thresh: float = 0.2
    initial: int | None = None  # None: start at min(n_agents, 2 * alpha)

    name: ClassVar[str] = "aimd"
    unit: ClassVar[Unit] = "agent"

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, int) and self.alpha >= 1):
            raise ValueError(f"--alpha must be an integer >= 1, got {self.alpha!r}")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"--beta must be in (0, 1), got {self.beta!r}")
        if not 0.0 <= self.u_low < self.u_high <= 1.0:
            raise ValueError(
                f"need 0 <= --u-low < --u-high <= 1, got u_low={self.u_low!r}, "
                f"u_high={self.u_high!r}"
            )
        if not 0.0 <= self.h_thresh <= 1.0:
            raise ValueError(f"--h-thresh must be in [0, 1], got {self.h_thresh!r}")
        if self.initial is not None and self.initial < 1:
            raise ValueError(f"--initial-window must be >= 1, got {self.initial!r}")

    def initial_window(self, n_agents: int) -> int:
        w = self.initial if self.initial is not None else 2 * self.alpha
        return max(1, min(w, max(1, n_agents)))

    def update(self, s: Signals) -> Decision:
        if s.usage is None:
            return Decision(s.window, "hold:no-usage-signal")
        if s.usage < self.u_low:
            return Decision(s.window + self.alpha, "increase")
        if s.usage > self.u_high and s.hit_rate is not None and s.hit_rate < self.h_thresh:
            return Decision(max(1, math.floor(s.window * self.beta)), "decrease")
        return Decision(s.window, "hold")

    def params(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NoGate:
    """No admission control: every agent active at once (the uncontrolled engine)."""

    name: ClassVar[str] = "none"
    unit: ClassVar[Unit] = "agent"

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
    unit: ClassVar[Unit] = "agent"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"agent-cap:N needs N >= 1, got {self.n}")

    def initial_window(self, n_agents: int) -> int:
        return self.n

    def update(self, s: Signals) -> Decision:
        return Decision(self.n, "fixed")

    def params(self) -> dict[str, Any]:
        return {"n": self.n}


@dataclass(frozen=True)
class RequestCap:
    """At most N generation requests in flight; an agent in a tool call holds nothing
    (the paper's request-level baseline)."""

    n: int
    name: ClassVar[str] = "request-cap"
    unit: ClassVar[Unit] = "request"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"request-cap:N needs N >= 1, got {self.n}")

    def initial_window(self, n_agents: int) -> int:
        return self.n

    def update(self, s: Signals) -> Decision:
        return Decision(self.n, "fixed")

    def params(self) -> dict[str, Any]:
        return {"n": self.n}


# name -> factory(arg, options). `arg` is the text after ':' in "name:arg" (or None).
REGISTRY: dict[str, Any] = {
    "aimd": lambda arg, o: AIMD(**o),
    "none": lambda arg, o: NoGate(),
    "agent-cap": lambda arg, o: AgentCap(_int_arg("agent-cap", arg)),
    "request-cap": lambda arg, o: RequestCap(_int_arg("request-cap", arg)),
}


def _int_arg(name: str, arg: str | None) -> int:
    try:
        return int(arg or "")
    except ValueError:
        raise ValueError(f"policy {name!r} needs a number: {name}:N (e.g. {name}:32)") from None


def make_policy(spec: str, **options: Any) -> Policy:
    """Build a policy from "name" or "name:arg". `options` go to policies that take them
    (the AIMD parameters); policies that take none ignore them."""
    name, _, arg = spec.partition(":")
    if name not in REGISTRY:
        raise ValueError(
            f"unknown policy {spec!r}; choose one of: aimd, none, agent-cap:N, request-cap:N"
        )
    return REGISTRY[name](arg or None, options)
