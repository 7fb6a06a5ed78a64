"""Plain PyTorch reference: the oracle every other path is tested against.

Obviously correct rather than fast: it materialises the full fp32 [N, V]
logits for every token of the packed batch, relies on autograd for the
backward pass, and recomputes packed-batch bookkeeping with simple loops and
``repeat_interleave`` instead of sharing helpers with the fast paths.
Shapes and dtypes are documented on the public functions in ``dispatch.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import advantage_estimators, kl_estimators
from .loss_settings import LossSettings
from .loss_types import get_loss_type
from .objective import Objective


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def _logits(hidden, weight, bias, temperature):
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return logits / temperature


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    logp_all = torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)
    return logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    # sqrt has an infinite derivative at 0; for a constant group the true
    # derivative of the advantage is finite (the std term is multiplied by
    # R - mean == 0), so keep NaN out of the gradient with the double-where.
    pos = x > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, x, torch.ones_like(x))), torch.zeros_like(x))


def group_advantages(
    rewards: torch.Tensor, seq_group: torch.Tensor, eps: float = 1e-6, estimator: str = "grpo"
) -> torch.Tensor:
    est = advantage_estimators.get_advantage_estimator(estimator)
    r = rewards.float()
    out = torch.zeros_like(r)
    for g in torch.unique(seq_group).tolist():
        idx = (seq_group == g).nonzero().reshape(-1)
        rg = r[idx]
        n = rg.numel()
        # Shifting by the first member makes the mean of a constant group
        # exactly equal to its value, so the advantage is exactly 0.
        pivot = rg[0].detach()
        mean = pivot + (rg - pivot).mean()
        dev = rg - mean
        adv = dev
        if est.leave_one_out and n > 1:
            # RLOO's baseline taken literally: the mean of the other members.
            shifted = rg - pivot
            adv = shifted - (shifted.sum() - shifted) / (n - 1)
        if est.scale_by_std:
            std = _safe_sqrt((dev * dev).sum() / max(n - est.ddof, 1))
            adv = adv / (std + eps)
        out = out.index_put((idx,), adv)
    return out


def _kl(logp, ref, obj: Objective):
    """The KL estimator's value, differentiated by autograd: a straight-through
    estimator carries its gradient formula's value with that value cancelled."""
    est = kl_estimators.get_kl_estimator(obj.kl_estimator)
    x = logp - ref
    if obj.log_ratio_clamp is not None:
        x = x.clamp(-obj.log_ratio_clamp, obj.log_ratio_clamp)
    kl = kl_estimators.base_value(est.value, x)
    if est.gradient != est.value:
        carrier = kl_estimators.base_value(est.gradient, x)
        kl = kl.detach() + (carrier - carrier.detach())
    if obj.kl_clamp is not None:
        kl = kl.clamp(-obj.kl_clamp, obj.kl_clamp)
    return kl


def _per_token_terms(logp, old_logp, ref_logp, adv_tok, obj: Objective):
    if old_logp is None:
        # On-policy: ratio 1 with derivative 1 (logp - its own value), and 1
        # with no derivative where logp is infinite (inf - inf would be NaN).
        log_ratio = torch.where(torch.isfinite(logp), logp - logp.detach(), torch.zeros_like(logp))
    else:
        log_ratio = logp - old_logp.detach().float()
    if obj.log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-obj.log_ratio_clamp, obj.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - obj.eps_low, 1.0 + obj.eps_high)
    per_tok = -torch.min(ratio * adv_tok, clipped_ratio * adv_tok)
    is_dual = torch.zeros_like(ratio, dtype=torch.bool)
    if obj.dual_clip:
        # verl's dual clip, as written there: min(-A c, loss) for A < 0.
        lower = -adv_tok * obj.clip_ratio_c
        is_dual = (adv_tok < 0) & (per_tok > lower)
        per_tok = torch.where(adv_tok < 0, torch.minimum(lower, per_tok), per_tok)
    kl = None
    if ref_logp is not None:
        ref = ref_logp.detach().float()
        kl = kl_estimators.statistic(logp.detach(), ref, obj.kl_estimator, obj.log_ratio_clamp, obj.kl_clamp)
        if obj.beta != 0.0:
            per_tok = per_tok + obj.beta * _kl(logp, ref, obj)
    lo, hi = 1.0 - obj.eps_low, 1.0 + obj.eps_high
    is_clipped = ((ratio > hi) & (adv_tok > 0)) | ((ratio < lo) & (adv_tok < 0))
    return per_tok, kl, is_clipped, is_dual


def grpo_loss(
    logp: torch.Tensor,
    old_logp: Optional[torch.Tensor],
    ref_logp: Optional[torch.Tensor],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    loss_type: str = "grpo",
    max_tokens: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
    clip_ratio_c: Optional[float] = None,
    kl_estimator: str = "k3",
    log_ratio_clamp: Optional[float] = None,
    kl_clamp: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """``token_weights`` [N] multiplies each token's whole loss (clipped term
    and KL) before the reduction; it is a constant (no gradient).
    ``old_logp``, ``ref_logp`` and ``token_weights`` may be [N] or [M] (the
    loss tokens in order)."""
    obj = Objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp)
    settings = LossSettings(obj, loss_type, max_tokens)
    return _loss_from_logprobs(logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, token_weights, None,
                               settings)


def _loss_from_logprobs(logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, token_weights, entropy,
                        settings: LossSettings):
    """The loss and stats of both losses from per-token log-probs. ``entropy``
    ([N] fp32 per-token entropies, or None) only feeds the statistic."""
    obj = settings.objective
    if obj.beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    mask = loss_mask.bool()
    n = logp.numel()
    old_logp, ref_logp, token_weights = (_scatter_if_gathered(t, mask, n) for t in (old_logp, ref_logp, token_weights))
    # Values at non-loss positions are arbitrary (often 0, -inf or NaN, and
    # so may be an advantage of a sequence without loss tokens): pin every
    # input there to a harmless 0, so that nothing overflows exp() or leaks
    # NaN into the gradient through the masked-out branch.
    logp = torch.where(mask, logp.float(), torch.zeros((), device=logp.device))
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=logp.device), lengths)
    adv_tok = torch.where(mask, advantages.detach().float()[seq_of_token], torch.zeros((), device=logp.device))
    if old_logp is not None:
        old_logp = torch.where(mask, old_logp.float(), logp.detach())
    if ref_logp is not None:
        ref_logp = torch.where(mask, ref_logp.float(), logp.detach())

    per_tok, kl, is_clipped, is_dual = _per_token_terms(logp, old_logp, ref_logp, adv_tok, obj)
    if token_weights is not None:
        # Pinned to 1 off the loss tokens, so an arbitrary value there (inf)
        # cannot turn the masked branch's gradient into NaN.
        per_tok = per_tok * torch.where(mask, token_weights.detach().float(), torch.ones_like(per_tok))
    per_tok = torch.where(mask, per_tok, torch.zeros_like(per_tok))
    loss = _reduce(per_tok, mask, cu_seqlens, settings)

    denom = mask.sum().clamp(min=1).float()
    with torch.no_grad():
        stats = {"clip_frac": (is_clipped & mask).sum().float() / denom}
        if obj.dual_clip:
            stats["clip_frac_lower"] = (is_dual & mask).sum().float() / denom
        if kl is not None:
            stats["kl"] = torch.where(mask, kl, torch.zeros_like(kl)).sum() / denom
        if entropy is not None:
            stats["entropy"] = torch.where(mask, entropy, torch.zeros_like(entropy)).sum() / denom
    return loss, stats


def _reduce(per_tok, mask, cu_seqlens, settings: LossSettings):
    """The reduction from the loss type's definition, sequence by sequence
    (the fast paths use its per-sequence weight vector instead)."""
    reduction = get_loss_type(settings.loss_type)
    num_seqs = cu_seqlens.numel() - 1
    bounds = [(int(cu_seqlens[s]), int(cu_seqlens[s + 1])) for s in range(num_seqs)]
    counts = torch.tensor([int(mask[a:b].sum()) for a, b in bounds], dtype=torch.long, device=per_tok.device)
    if reduction.mean_within_sequence:
        terms = [per_tok[a:b].sum() / counts[s] for s, (a, b) in enumerate(bounds) if counts[s] > 0]
    else:
        terms = [per_tok.sum()]
    denominator = max(int(reduction.count(counts)), 1)
    if reduction.scaled_by_max_tokens:
        max_tokens = settings.max_tokens
        if max_tokens is None:
            max_tokens = max(int(counts.max()) if num_seqs else 1, 1)
        denominator = denominator * float(max_tokens)
    return torch.stack(terms).sum() / denominator if terms else per_tok.sum() * 0.0


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    *,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict]:
    mask = loss_mask.bool()
    # The naive path: every token of the packed batch is projected and scored.
    # Rows off the loss mask are zeroed first, so that whatever they hold
    # (NaN, inf) reaches neither the loss nor any gradient.
    hidden = torch.where(mask[:, None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    logp_all = torch.log_softmax(_logits(hidden, weight, bias, settings.temperature), dim=-1)
    logp = logp_all.gather(-1, targets.long().clamp(0, weight.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
    entropy = None
    if settings.compute_entropy:
        with torch.no_grad():
            p = logp_all.exp()
            entropy = -torch.special.xlogy(p, p).sum(-1)  # 0 log 0 = 0 where a logit is -inf
    return _loss_from_logprobs(logp, old_logp, ref_logp, advantages, mask, cu_seqlens, token_weights, entropy,
                               settings)


def _scatter_if_gathered(values, mask, n):
    """Accept per-token values given on the loss tokens only ([M]) by placing
    them back on the packed positions ([N]); non-loss positions get 0."""
    if values is None or values.numel() == n:
        return values
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    out[mask] = values.float()
    return out
