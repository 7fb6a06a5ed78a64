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

from .loss_types import get_loss_type


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
    rewards: torch.Tensor, seq_group: torch.Tensor, eps: float = 1e-6, scale: str = "group"
) -> torch.Tensor:
    if scale not in ("group", "none"):
        raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
    r = rewards.float()
    out = torch.zeros_like(r)
    for g in torch.unique(seq_group).tolist():
        idx = (seq_group == g).nonzero().reshape(-1)
        rg = r[idx]
        # Shifting by the first member makes the mean of a constant group
        # exactly equal to its value, so the advantage is exactly 0.
        pivot = rg[0].detach()
        mean = pivot + (rg - pivot).mean()
        dev = rg - mean
        adv = dev
        if scale == "group":
            std = _safe_sqrt((dev * dev).mean())  # population std (ddof=0)
            adv = dev / (std + eps)
        out = out.index_put((idx,), adv)
    return out


def _per_token_terms(logp, old_logp, ref_logp, adv_tok, eps_low, eps_high, beta):
    old = logp.detach() if old_logp is None else old_logp.detach().float()
    ratio = torch.exp(logp - old)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_tok = -torch.min(ratio * adv_tok, clipped_ratio * adv_tok)
    kl = None
    if ref_logp is not None:
        d = ref_logp.detach().float() - logp
        kl = torch.exp(d) - d - 1.0
        if beta != 0.0:
            per_tok = per_tok + beta * kl
    is_clipped = ((ratio > 1.0 + eps_high) & (adv_tok > 0)) | ((ratio < 1.0 - eps_low) & (adv_tok < 0))
    return per_tok, kl, is_clipped


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
    entropy: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict]:
    """``entropy`` ([N] fp32 per-token entropies) only feeds the statistic;
    the fused-linear reference passes it when asked. ``token_weights`` [N]
    multiplies each token's whole loss (clipped term and KL) before the
    reduction; it is a constant (no gradient)."""
    reduction = get_loss_type(loss_type)
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    logp = logp.float()
    mask = loss_mask.bool()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    num_seqs = lengths.numel()
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=logp.device), lengths)
    adv_tok = advantages.detach().float()[seq_of_token]
    # Values at non-loss positions are arbitrary (often 0 or -inf); pin them
    # to logp so they cannot overflow exp() and leak NaN through the masked
    # branch's gradient.
    if old_logp is not None:
        old_logp = torch.where(mask, old_logp.float(), logp.detach())
    if ref_logp is not None:
        ref_logp = torch.where(mask, ref_logp.float(), logp.detach())

    per_tok, kl, is_clipped = _per_token_terms(logp, old_logp, ref_logp, adv_tok, eps_low, eps_high, beta)
    if token_weights is not None:
        # Pinned to 1 off the loss tokens, so an arbitrary value there (inf)
        # cannot turn the masked branch's gradient into NaN.
        per_tok = per_tok * torch.where(mask, token_weights.detach().float(), torch.ones_like(per_tok))
    per_tok = torch.where(mask, per_tok, torch.zeros_like(per_tok))
    n_tok = mask.sum()

    # The reduction from the loss type's definition, sequence by sequence
    # (the fast paths use its per-sequence weight vector instead).
    bounds = [(int(cu_seqlens[s]), int(cu_seqlens[s + 1])) for s in range(num_seqs)]
    counts = torch.tensor([int(mask[a:b].sum()) for a, b in bounds], dtype=torch.long, device=logp.device)
    if reduction.mean_within_sequence:
        terms = [per_tok[a:b].sum() / counts[s] for s, (a, b) in enumerate(bounds) if counts[s] > 0]
    else:
        terms = [per_tok.sum()]
    denominator = max(int(reduction.count(counts)), 1)
    if reduction.scaled_by_max_tokens:
        if max_tokens is None:
            max_tokens = max(int(counts.max()) if num_seqs else 1, 1)
        denominator = denominator * float(max_tokens)
    loss = torch.stack(terms).sum() / denominator if terms else per_tok.sum() * 0.0

    denom = n_tok.clamp(min=1).float()
    with torch.no_grad():
        stats = {"clip_frac": (is_clipped & mask).sum().float() / denom}
        if kl is not None:
            stats["kl"] = torch.where(mask, kl, torch.zeros_like(kl)).sum() / denom
        if entropy is not None:
            stats["entropy"] = torch.where(mask, entropy, torch.zeros_like(entropy)).sum() / denom
    return loss, stats


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    temperature: float = 1.0,
    loss_type: str = "grpo",
    bias: Optional[torch.Tensor] = None,
    max_tokens: Optional[float] = None,
    compute_entropy: bool = False,
    token_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict]:
    n = hidden.shape[0]
    mask = loss_mask.bool()
    old_logp = _scatter_if_gathered(old_logp, mask, n)
    ref_logp = _scatter_if_gathered(ref_logp, mask, n)
    token_weights = _scatter_if_gathered(token_weights, mask, n)
    # The naive path: every token of the packed batch is projected and scored.
    logp_all = torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if compute_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return grpo_loss(
        logp, old_logp, ref_logp, advantages, mask, cu_seqlens,
        eps_low, eps_high, beta, loss_type, max_tokens, entropy, token_weights,
    )


def _scatter_if_gathered(values, mask, n):
    """Accept per-token values given on the loss tokens only ([M]) by placing
    them back on the packed positions ([N]); non-loss positions get 0."""
    if values is None or values.numel() == n:
        return values
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    out[mask] = values.float()
    return out
