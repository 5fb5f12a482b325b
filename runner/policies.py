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
    # Richer signals; None / empty where the engine or the gate cannot tell.
    capacity_tokens: int | None = None  # the engine's KV pool size, tokens
    held_contexts: tuple[int, ...] = ()  # slot holders' contexts, in keep order
    waiting_contexts: tuple[int, ...] = ()  # waiting agents' contexts, in admission order
    growth_per_step: float | None = None  # mean context growth per agent step, tokens
    recompute_rate: float | None = None  # prompt tokens neither cached nor new, this period
    shared_tokens: int | None = None  # prefix all agents share (e.g. the system prompt)


@dataclass(frozen=True)
class Decision:
    window: int
    branch: str  # why: "increase" | "decrease" | "hold" | "fixed" ...


class Policy(Protocol):
    name: str
    unit: Unit  # what a slot is held for: a whole agent life, or one request
    wants_contexts: bool  # whether Signals must carry every agent's context (O(n) a period)

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
    wants_contexts: ClassVar[bool] = False

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
    wants_contexts: ClassVar[bool] = False

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
    wants_contexts: ClassVar[bool] = False

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


@dataclass(frozen=True)
class WorkingSet:
    """Working-set admission (Denning's load control, applied to KV cache).

    Admit agents, in the order the gate would keep or admit them, while the sum of their
    projected contexts (context + `headroom_steps` x the measured growth per step) fits
    `target` x the engine's KV capacity. Agents in tool calls count in full: their prefixes
    are exactly what LRU would evict. The window thus opens wide at once in warmup (short
    contexts) and closes as contexts grow, ahead of thrashing rather than after it.

    Feedback as a correction: when the recompute rate measured this period (prompt tokens
    the engine had seen but no longer cached) exceeds `max_recompute`, the capacity estimate
    is too optimistic: the window is cut by `beta` below the fit.

    Without a capacity signal (an engine that cannot tell), it behaves as AIMD and says so
    in its branch ("aimd-fallback:...").
    """

    target: float = 0.9
    headroom_steps: float = 1.0
    max_recompute: float = 0.3
    beta: float = 0.5
    fallback: AIMD = AIMD()

    name: ClassVar[str] = "wset"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 2.0:  # above 1: deliberate overcommit
            raise ValueError(f"wset target must be in (0, 2], got {self.target!r}")
        if self.headroom_steps < 0:
            raise ValueError(f"wset headroom_steps must be >= 0, got {self.headroom_steps!r}")
        if not 0.0 < self.max_recompute <= 1.0:
            raise ValueError(f"wset max_recompute must be in (0, 1], got {self.max_recompute!r}")
        if not 0.0 < self.beta <= 1.0:  # 1: no cut on recompute
            raise ValueError(f"wset beta must be in (0, 1], got {self.beta!r}")

    def initial_window(self, n_agents: int) -> int:
        return max(1, n_agents)  # nothing is resident yet: the first update fits it

    def update(self, s: Signals) -> Decision:
        if not s.capacity_tokens:
            d = self.fallback.update(s)
            return Decision(d.window, f"aimd-fallback:{d.branch}")
        growth = (s.growth_per_step or 0.0) * self.headroom_steps
        shared = s.shared_tokens or 0
        budget = self.target * s.capacity_tokens - shared  # the shared prefix, stored once
        fit = 0
        for ctx in (*s.held_contexts, *s.waiting_contexts):
            budget -= max(0, ctx - shared) + growth
            if budget < 0:
                break
            fit += 1
        fit = max(1, fit)
        if s.recompute_rate is not None and s.recompute_rate > self.max_recompute:
            return Decision(max(1, min(fit, math.floor(s.window * self.beta))), "cut:recompute")
        return Decision(fit, "fit")

    def params(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("fallback")
        return d


# name -> factory(arg, options). `arg` is the text after ':' in "name:arg" (or None).
REGISTRY: dict[str, Any] = {
    "aimd": lambda arg, o: AIMD(**o),
    "none": lambda arg, o: NoGate(),
    "agent-cap": lambda arg, o: AgentCap(_int_arg("agent-cap", arg)),
    "request-cap": lambda arg, o: RequestCap(_int_arg("request-cap", arg)),
    "wset": lambda arg, o: WorkingSet(fallback=AIMD(**o)),
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
            f"unknown policy {spec!r}; choose one of: aimd, wset, none, agent-cap:N, request-cap:N"
        )
    return REGISTRY[name](arg or None, options)
