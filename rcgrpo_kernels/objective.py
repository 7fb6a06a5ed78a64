"""The per-token clipped objective: its settings, checked once, and its
analytic value and derivative (the chunked path's; the Triton kernels mirror
it in ``rcgrpo_kernels.triton.common.grpo_token``, the reference differentiates its
own formulation with autograd).

Per loss token, with ``x = logp - old`` (clamped to [-c, c] when
``log_ratio_clamp`` is c), ``r = exp(x)`` and A the sequence's advantage::

    pg = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    pg = min(pg, -clip_ratio_c A)   where A < 0, when dual-clip is on (verl)
    l  = pg + beta * KL             KL: a ``rcgrpo_kernels.KL_ESTIMATORS`` estimator

NaN is never hidden: a NaN log-prob, old/ref log-prob, advantage or token
weight on a loss token makes that token's loss and derivative NaN (the
operations here, like torch.minimum, propagate it; the Triton kernels ask
for the same with ``propagate_nan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import kl_estimators

__all__ = ["Objective", "token_terms"]


def finite_number(name: str, value, low: float, *, strict: bool = False) -> float:
    """``value`` as a float, or a one-line ValueError naming ``name`` unless it
    is finite and >= ``low`` (> ``low`` when ``strict``)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < low or (strict and v == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
    return v


@dataclass(frozen=True)
class Objective:
    """The settings of the clipped objective (defaults: the paper's, with k3).

    eps_low, eps_high: the clip range of the ratio, [1 - eps_low, 1 + eps_high].
    beta: the KL coefficient. clip_ratio_c: dual-clip PPO's bound on the ratio
    of negative-advantage tokens (> 1; verl's default 3.0); None = off.
    kl_estimator: a name in ``rcgrpo_kernels.KL_ESTIMATORS``. log_ratio_clamp: clamp
    of logp - old and logp - ref before use (verl: 20); None = off. kl_clamp:
    clamp of the KL value (verl: 10 for k3); None = off.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    clip_ratio_c: Optional[float] = None
    kl_estimator: str = "k3"
    log_ratio_clamp: Optional[float] = None
    kl_clamp: Optional[float] = None

    def __post_init__(self):
        check = object.__setattr__
        check(self, "eps_low", finite_number("eps_low", self.eps_low, 0.0))
        check(self, "eps_high", finite_number("eps_high", self.eps_high, 0.0))
        check(self, "beta", finite_number("beta", self.beta, 0.0))
        if self.clip_ratio_c is not None:
            check(self, "clip_ratio_c", finite_number("clip_ratio_c", self.clip_ratio_c, 1.0, strict=True))
        if self.log_ratio_clamp is not None:
            check(self, "log_ratio_clamp", finite_number("log_ratio_clamp", self.log_ratio_clamp, 0.0, strict=True))
        if self.kl_clamp is not None:
            check(self, "kl_clamp", finite_number("kl_clamp", self.kl_clamp, 0.0, strict=True))
        kl_estimators.get_kl_estimator(self.kl_estimator)

    @property
    def dual_clip(self) -> bool:
        return self.clip_ratio_c is not None

    def stat_keys(self, has_ref: bool, entropy: bool = False) -> list[str]:
        """The statistics a loss returns, in the order of its outputs:
        ``clip_frac``; ``clip_frac_lower`` (share of loss tokens held by the
        dual clip, verl's pg_clipfrac_lower) when it is on; ``kl`` with a
        reference; ``entropy`` when asked."""
        return (["clip_frac"] + (["clip_frac_lower"] if self.dual_clip else []) + (["kl"] if has_ref else [])
                + (["entropy"] if entropy else []))

    def triton_args(self) -> dict:
        """The runtime scalars of ``rcgrpo_kernels.triton.common.grpo_token`` (an
        unset bound is +inf, which clamps nothing)."""
        est = kl_estimators.get_kl_estimator(self.kl_estimator)
        inf = float("inf")
        lr = inf if self.log_ratio_clamp is None else self.log_ratio_clamp
        return dict(eps_low=self.eps_low, eps_high=self.eps_high, beta=self.beta,
                    clip_c=inf if self.clip_ratio_c is None else self.clip_ratio_c,
                    lr_clamp=lr, stat_clamp=min(lr, kl_estimators.STAT_LOG_RATIO_CLAMP),
                    kl_clamp=inf if self.kl_clamp is None else self.kl_clamp,
                    kl_value=est.value_index, kl_grad=est.gradient_index)


def token_terms(logp: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor], adv: torch.Tensor,
                obj: Objective):
    """Per-token loss and d loss / d logp, all fp32 [M], for the loss tokens.

    The min picks the clipped branch exactly when the ratio left the trust
    region in the direction the advantage pushes it; there (and where the
    dual clip holds a negative-advantage token at -c A) the policy-gradient
    term is constant, so its derivative is 0, else -A r.
    Returns (loss, dloss, is_clipped, dual_clipped, kl statistic or None).
    """
    if old is not None:
        x, through = kl_estimators.clamp_through(logp - old, obj.log_ratio_clamp)
        ratio = torch.exp(x)
    else:
        ratio, through = torch.ones_like(logp), torch.ones_like(logp)
    lo, hi = 1.0 - obj.eps_low, 1.0 + obj.eps_high
    is_clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    loss = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    # The factor multiplies (rather than selects) so that NaN stays NaN.
    dloss = torch.where(is_clipped, torch.zeros_like(ratio), -adv * ratio) * through
    dual = torch.zeros_like(is_clipped)
    if obj.dual_clip:
        dual = (adv < 0) & (ratio > obj.clip_ratio_c)
        loss = torch.where(dual, -adv * obj.clip_ratio_c, loss)
        dloss = torch.where(dual, torch.zeros_like(dloss), dloss)
    kl_stat = None
    if ref is not None:
        kl, dkl, kl_stat = kl_estimators.kl_terms(logp, ref, obj.kl_estimator, obj.log_ratio_clamp, obj.kl_clamp)
        if obj.beta != 0.0:  # keeps an infinite KL out of the loss when it is unweighted
            loss = loss + obj.beta * kl
            dloss = dloss + obj.beta * dkl
    return loss, dloss, is_clipped, dual, kl_stat
