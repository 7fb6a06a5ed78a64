"""Intervals for success rates: what every reported reward carries.

The rewards are binary, so a mean reward over n rollouts is a binomial
proportion: its 95% interval is Wilson's score interval (good at small n and
near 0 or 1, where the normal approximation fails), and the interval of a
difference of two independent proportions is Newcombe's method 10, built
from the two Wilson intervals. Plain Python: reports import it cheaply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Z95", "Rate", "wilson", "newcombe", "rate", "difference"]

Z95 = 1.959964


def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion k / n ((0, 1) for n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """95% interval of p1 - p2 for independent samples (Newcombe's method 10)."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1)
    l2, u2 = wilson(k2, n2)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


@dataclass(frozen=True)
class Rate:
    """k successes of n, with the 95% Wilson interval."""

    k: int
    n: int

    @property
    def mean(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def ci(self) -> tuple[float, float]:
        return wilson(self.k, self.n)

    def __str__(self) -> str:
        lo, hi = self.ci
        return f"{self.mean:.3f} [{lo:.3f}, {hi:.3f}] (n={self.n})"


def rate(rewards: Sequence[float]) -> Rate:
    """The success rate of binary rewards (a reward of 1 is a success)."""
    return Rate(sum(1 for r in rewards if r >= 1.0), len(rewards))


def difference(a: Rate, b: Rate) -> tuple[float, tuple[float, float]]:
    """a - b and its 95% interval (Newcombe)."""
    return a.mean - b.mean, newcombe(a.k, a.n, b.k, b.n)
