"""Helpers of the working-set policies (wset2, and the experiment wset): fall back on AIMD,
cut or fit, the pool they fit to."""

from __future__ import annotations

import math

from .aimd import AIMD
from .protocol import Decision, Signals


def _aimd_fallback(fallback: AIMD, s: Signals) -> Decision:
    """`wset`'s and `wset2`'s law where the engine reports no pool size."""
    d = fallback.update(s)
    return Decision(d.window, f"aimd-fallback:{d.branch}")


def _cut_or_fit(s: Signals, fit: int, max_recompute: float, beta: float) -> Decision:
    """The fitted window, cut by `beta` while the recompute rate is above `max_recompute`."""
    fit = max(1, fit)
    if s.recompute_rate is not None and s.recompute_rate > max_recompute:
        return Decision(max(1, min(fit, math.floor(s.window * beta))), "cut:recompute")
    return Decision(fit, "fit")


def _check_fit_params(name: str, headroom_steps: float, max_recompute: float, beta: float) -> None:
    """The checks `wset` and `wset2` share."""
    if headroom_steps < 0:
        raise ValueError(f"{name} headroom_steps must be >= 0, got {headroom_steps!r}")
    if not 0.0 < max_recompute <= 1.0:
        raise ValueError(f"{name} max_recompute must be in (0, 1], got {max_recompute!r}")
    if not 0.0 < beta <= 1.0:  # 1: no cut on recompute
        raise ValueError(f"{name} beta must be in (0, 1], got {beta!r}")


def _capacity(s: Signals, use_host: bool) -> float:
    """The device pool, plus the host tier where the engine has one and reloading from it is
    cheaper than recomputing (an agent whose KV went to host comes back for a PCIe copy
    instead of a prefill): the part of it beyond the device's own copies, since
    write-through keeps a host copy of what the device holds."""
    device = float(s.capacity_tokens or 0)
    if not use_host or not s.host_capacity_tokens or s.host_reload_cost is None:
        return device
    extra = max(0.0, s.host_capacity_tokens - device)
    return device + (extra if s.host_reload_cost < 1.0 else 0.0)
