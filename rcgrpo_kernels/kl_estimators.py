"""The KL estimators: how the per-token penalty to the reference policy is
computed from one sampled token. The one home of their names and formulas.

Every estimator is a function of ``x = logp - ref_logp`` on a loss token
(Schulman, "Approximating KL divergence", 2020; the names verl uses):

=======  ======================  ===========================  =====================
name     value                   d value / d logp             verl / TRL name
=======  ======================  ===========================  =====================
k1       x                       1                            ``kl`` / ``k1``
abs      abs(x)                  sign(x)                      ``abs``
k2       x^2 / 2                 x                            ``mse`` / ``k2``
k3       exp(-x) + x - 1         1 - exp(-x)                  ``low_var_kl`` / ``k3``;
                                                              TRL's only estimator
k1+      x                       x  (k2's gradient)           ``k1+``
abs+     abs(x)                  x                            ``abs+``
k3+      exp(-x) + x - 1         x                            ``k3+``
=======  ======================  ===========================  =====================

k3 is the default (the paper's, verl's ``low_var_kl``, TRL's). The "+"
variants are verl's straight-through estimators: the value (and the ``kl``
statistic) of the named one, the gradient of k2, whose expected gradient is
the true KL's. An estimator is a pair of *base* formulas (one for the value,
one for the gradient) so that every path, Triton included, runs any
registered pair; the Triton kernels select the bases by their index in
``BASES`` at run time (no extra compiled variants).

Clamping (off by default, today's and TRL's behaviour): ``log_ratio_clamp``
clamps x to [-c, c] before the formula (verl: 20), ``kl_clamp`` clamps the
value to [-c, c] (verl: 10, for k3 only). A clamped x or value has gradient
0, as torch.clamp's. The ``kl`` *statistic* always reads x clamped to
[-STAT_LOG_RATIO_CLAMP, STAT_LOG_RATIO_CLAMP] (or the tighter loss clamp),
so a -inf log-prob on a loss token gives a large finite statistic instead of
NaN (inf - inf); the loss itself keeps the unclamped value unless asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch

__all__ = ["KLEstimator", "KL_ESTIMATORS", "BASES", "get_kl_estimator", "kl_terms", "STAT_LOG_RATIO_CLAMP"]

# The base formulas, in the order the Triton kernels index them.
BASES = ("k1", "abs", "k2", "k3")
# |x| the kl statistic reads at most (see the module docstring).
STAT_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class KLEstimator:
    """One estimator: the base formula of its value and of its gradient."""

    name: str
    value: str
    gradient: str
    description: str = ""

    def __post_init__(self):
        for base in (self.value, self.gradient):
            if base not in BASES:
                raise ValueError(f"KL estimator {self.name!r}: base {base!r} is not one of {BASES}")

    @property
    def value_index(self) -> int:
        return BASES.index(self.value)

    @property
    def gradient_index(self) -> int:
        return BASES.index(self.gradient)


_REGISTRY: dict[str, KLEstimator] = {}
KL_ESTIMATORS: Mapping[str, KLEstimator] = MappingProxyType(_REGISTRY)


def _register(est: KLEstimator) -> None:
    _REGISTRY[est.name] = est


_register(KLEstimator("k3", "k3", "k3", "exp(-x) + x - 1, x = logp - ref (default; verl low_var_kl, TRL)"))
_register(KLEstimator("k1", "k1", "k1", "x"))
_register(KLEstimator("k2", "k2", "k2", "x^2 / 2 (verl mse)"))
_register(KLEstimator("abs", "abs", "abs", "|x|"))
_register(KLEstimator("k1+", "k1", "k2", "k1's value, k2's gradient (straight-through)"))
_register(KLEstimator("abs+", "abs", "k2", "|x|'s value, k2's gradient (straight-through)"))
_register(KLEstimator("k3+", "k3", "k2", "k3's value, k2's gradient (straight-through)"))


def get_kl_estimator(name: str) -> KLEstimator:
    """The registered estimator called ``name``; a ValueError listing the names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"kl_estimator must be one of {tuple(_REGISTRY)}, got {name!r}") from None


def base_value(base: str, x: torch.Tensor) -> torch.Tensor:
    if base == "k1":
        return x
    if base == "abs":
        return x.abs()
    if base == "k2":
        return 0.5 * x * x
    return torch.exp(-x) + x - 1.0  # k3


def base_gradient(base: str, x: torch.Tensor) -> torch.Tensor:
    if base == "k1":
        return torch.ones_like(x)
    if base == "abs":
        return torch.sign(x)
    if base == "k2":
        return x
    return 1.0 - torch.exp(-x)  # k3


def clamp_through(x: torch.Tensor, bound: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x clamped to [-bound, bound], 1.0 where the clamp let x through else 0.0).
    The factor multiplies a derivative, so a NaN x keeps a NaN derivative."""
    if bound is None:
        return x, torch.ones_like(x)
    return x.clamp(-bound, bound), (x.abs() <= bound).to(x.dtype)


def kl_terms(logp: torch.Tensor, ref: torch.Tensor, estimator: str, log_ratio_clamp: Optional[float] = None,
             kl_clamp: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (value, d value / d logp, statistic) of ``estimator``, fp32.

    The chunked path's analytic form; ``rcgrpo_kernels.triton.common.kl_token``
    mirrors it and the reference differentiates ``reference_kl`` instead."""
    est = get_kl_estimator(estimator)
    x, through = clamp_through(logp - ref, log_ratio_clamp)
    value = base_value(est.value, x)
    grad = base_gradient(est.gradient, x) * through
    if kl_clamp is not None:
        grad = grad * (value.abs() <= kl_clamp).to(value.dtype)
        value = value.clamp(-kl_clamp, kl_clamp)
    return value, grad, statistic(logp, ref, estimator, log_ratio_clamp, kl_clamp)


def statistic(logp: torch.Tensor, ref: torch.Tensor, estimator: str, log_ratio_clamp: Optional[float] = None,
              kl_clamp: Optional[float] = None) -> torch.Tensor:
    """The per-token value the ``kl`` statistic averages: the estimator's value
    at x clamped to STAT_LOG_RATIO_CLAMP (or the tighter loss clamp)."""
    est = get_kl_estimator(estimator)
    bound = STAT_LOG_RATIO_CLAMP if log_ratio_clamp is None else min(log_ratio_clamp, STAT_LOG_RATIO_CLAMP)
    value = base_value(est.value, (logp - ref).clamp(-bound, bound))
    return value if kl_clamp is None else value.clamp(-kl_clamp, kl_clamp)
