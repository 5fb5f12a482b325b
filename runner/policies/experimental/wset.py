"""`wset`: a working-set fit to the pool, AIMD where it cannot tell (superseded by wset2;
kept as its baseline). An experiment: never imported by the default path."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ..aimd import AIMD
from ..fit import _aimd_fallback, _capacity, _check_fit_params, _cut_or_fit
from ..protocol import Decision, PauseRule, ResumeRule, Signals, Unit


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

    With a host KV tier (HiCache) whose reloads are cheaper than recomputes, the host tier
    beyond the device's own copies counts as capacity too (`use_host`): paused or evicted
    agents come back for a PCIe copy, so the working set may exceed the device.

    Without a capacity signal (an engine that cannot tell), it behaves as AIMD and says so
    in its branch ("aimd-fallback:...").
    """

    target: float = 0.9
    headroom_steps: float = 1.0
    max_recompute: float = 0.3
    beta: float = 0.5
    use_host: bool = True  # count a host KV tier the engine reports (see _capacity)
    fallback: AIMD = AIMD()

    name: ClassVar[str] = "wset"
    # LIFO both ways: the agent paused last is the likeliest to find its KV still cached
    rules: ClassVar[tuple[PauseRule, ResumeRule]] = ("newest", "newest")
    unit: ClassVar[Unit] = "agent"
    wants_contexts: ClassVar[bool] = True
    wants_tools: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 2.0:  # above 1: deliberate overcommit
            raise ValueError(f"wset target must be in (0, 2], got {self.target!r}")
        _check_fit_params("wset", self.headroom_steps, self.max_recompute, self.beta)

    def initial_window(self, n_agents: int) -> int:
        return max(1, n_agents)  # nothing is resident yet: the first update fits it

    def update(self, s: Signals) -> Decision:
        if not s.capacity_tokens:
            return _aimd_fallback(self.fallback, s)
        growth = (s.growth_per_step or 0.0) * self.headroom_steps
        shared = s.shared_tokens or 0
        budget = self.target * _capacity(s, self.use_host) - shared  # shared prefix stored once
        return _cut_or_fit(s, s.contexts.fit(budget, growth, shared), self.max_recompute, self.beta)

    def params(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("fallback")
        return d
