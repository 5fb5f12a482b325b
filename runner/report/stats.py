"""Estimators for reports: Wilson score intervals, the unbiased pass@k, and Newcombe's
interval for the difference of two paired proportions (the same tasks in two runs)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the 97.5% normal quantile


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def to_json(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high}


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval for a binomial proportion (good at 0 and n, unlike Wald's)."""
    if n <= 0:
        raise ValueError("a proportion of nothing has no interval")
    if not 0 <= successes <= n:
        raise ValueError(f"{successes} successes out of {n}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task from n samples with c correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_mean(samples: Sequence[tuple[int, int]], k: int) -> float:
    """Mean pass@k over tasks, each (n samples, c correct) with n >= k."""
    return sum(pass_at_k(n, c, k) for n, c in samples) / len(samples)


def ks_for(n_min: int) -> list[int]:
    """The k to report when every task has at least n_min samples."""
    return sorted({1, n_min, *(k for k in (2, 5, 10, 20, 50, 100) if k <= n_min)})


def newcombe(
    p1: float, ci1: tuple[float, float], p2: float, ci2: tuple[float, float], phi: float
) -> Interval:
    """Newcombe's hybrid score interval for p1 - p2 from each proportion's Wilson interval;
    `phi` is the correlation between the two (0 for independent samples: his method 10 for
    unpaired proportions; the 2x2 table's corrected phi for paired ones: method 10 of the
    paired paper; Newcombe 1998, Stat. Med. 17:873 and 17:2635)."""
    (l1, u1), (l2, u2) = ci1, ci2
    d = p1 - p2
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return Interval(d, max(-1.0, d - below), min(1.0, d + above))


def paired_difference(pairs: Sequence[tuple[bool, bool]], z: float = Z95) -> Interval:
    """The difference rate(second) - rate(first) over tasks scored in both runs, each pair
    (solved in the first, solved in the second), with its 95% interval."""
    n = len(pairs)
    if n == 0:
        raise ValueError("no task was scored in both runs")
    a = sum(1 for x, y in pairs if x and y)
    b = sum(1 for x, y in pairs if x and not y)  # lost
    c = sum(1 for x, y in pairs if y and not x)  # gained
    d = n - a - b - c
    second, first = wilson(a + c, n, z), wilson(a + b, n, z)
    denom = (a + b) * (c + d) * (a + c) * (b + d)
    # phi with Newcombe's continuity correction (as in Altman et al., Statistics with
    # Confidence, 2nd ed., p. 52): without it two identical runs get a zero-width interval
    ad_bc = a * d - b * c
    corrected = ad_bc - n / 2 if ad_bc > n / 2 else min(ad_bc, 0)
    phi = corrected / math.sqrt(denom) if denom else 0.0
    return newcombe(
        second.estimate, (second.low, second.high), first.estimate, (first.low, first.high), phi
    )
