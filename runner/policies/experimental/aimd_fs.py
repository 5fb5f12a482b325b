"""AIMD with a fast start (issue 31): the CONCUR law, except that while U is far below
U_low the window grows by a fraction of itself instead of by alpha.

Why: the paper's additive increase needs W/alpha periods to reach a window of W. Where many
short agents start together (a 2,048-agent swarm) the batch is half over before the window
is wide enough, and no gate at all wins. TCP met the same problem with slow start. A policy is
pure (no memory of a past cut), so the fast growth is tied to the signal, not to a phase:
it stops by itself once U nears U_low, and the law's decrease still answers thrashing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ..aimd import AIMD
from ..protocol import Decision, Signals, Unit


@dataclass(frozen=True)
class FastStartAIMD:
    """`aimd`, but W + max(alpha, floor(W * growth)) while U < U_low * room."""

    alpha: int = 2
    beta: float = 0.5
    u_low: float = 0.2
    u_high: float = 0.5
    h_thresh: float = 0.2
    initial: int | None = None
    growth: float = 0.5  # the fraction of W added per period while U is far below U_low
    room: float = 0.5  # "far below": U under this fraction of U_low

    name: ClassVar[str] = "aimd-fs"
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

    def __post_init__(self) -> None:
        AIMD(self.alpha, self.beta, self.u_low, self.u_high, self.h_thresh, self.initial)
        if not self.growth >= 0:
            raise ValueError(f"growth must be >= 0, got {self.growth!r}")
        if not 0.0 <= self.room <= 1.0:
            raise ValueError(f"room must be in [0, 1], got {self.room!r}")

    def initial_window(self, n_agents: int) -> int:
        w = self.initial if self.initial is not None else 2 * self.alpha
        return max(1, min(w, max(1, n_agents)))

    def update(self, s: Signals) -> Decision:
        if s.usage is not None and s.usage < self.u_low * self.room:
            step = max(self.alpha, math.floor(s.window * self.growth))
            return Decision(s.window + step, "increase:fast")
        law = AIMD(self.alpha, self.beta, self.u_low, self.u_high, self.h_thresh, self.initial)
        return law.update(s)

    def params(self) -> dict[str, Any]:
        return asdict(self)
