"""AIMD: the CONCUR law, the paper's policy and the baseline the default is measured against
(docs/policies.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from .protocol import Decision, PauseRule, ResumeRule, Signals, Unit


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
    rules: ClassVar[tuple[PauseRule, ResumeRule]] = ("newest", "oldest")  # the paper's
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = False
    wants_tools: ClassVar[bool] = False

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
