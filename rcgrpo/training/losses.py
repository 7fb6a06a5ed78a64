"""Losses on a packed batch, on the fused path or the reference path.

Each takes a `PackedLM` (the policy's `policy.lm`, or its reference): final
hidden states and the LM-head weight in the compute dtype. Fused (`--fused`):
the hidden states go straight into `kernels.fused_linear_*`, which project
only the loss rows onto the vocabulary, chunk by chunk (Triton on CUDA,
chunked PyTorch on CPU), never building [N, V] logits. Reference: full logits
and the plain PyTorch ops in `kernels.reference`. Both compute the same
numbers (tests/training/test_train_steps.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from rcgrpo.batch import PackedBatch
from rcgrpo.policy import PackedLM, TrainablePolicy


@dataclass(frozen=True)
class RLLossSettings:
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.1
    temperature: float = 1.0
    loss_type: str = "grpo"
    max_tokens: float | None = None  # dr_grpo's constant


def token_logprobs(lm: PackedLM, batch: PackedBatch, fused: bool, temperature: float = 1.0,
                   hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[M] log-probs of the targets at the M loss positions (in order).
    `hidden` reuses final hidden states already computed for this batch."""
    hidden = lm.hidden_states(batch) if hidden is None else hidden
    mask = batch.loss_mask
    if fused:
        return kernels.fused_linear_logprobs(hidden[mask], lm.lm_head_weight(), batch.targets[mask], temperature)
    return kernels.token_logprobs(lm.logits(hidden), batch.targets, temperature, impl="reference")[mask]


def sft_loss(lm: PackedLM, batch: PackedBatch, fused: bool,
             hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean negative log-likelihood of the generated (assistant) tokens."""
    logp = token_logprobs(lm, batch, fused, hidden=hidden)
    if logp.numel() == 0:
        return logp.sum(), {"nll": 0.0, "loss_tokens": 0}
    nll = -logp.mean()
    return nll, {"nll": float(nll.detach()), "loss_tokens": int(logp.numel())}


@torch.no_grad()
def reference_logprobs(policy: TrainablePolicy, batch: PackedBatch, fused: bool, temperature: float,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[N] log-probs of the policy's frozen reference, 0 off the loss positions."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    with policy.reference() as ref:
        out[batch.loss_mask] = token_logprobs(ref, batch, fused, temperature, hidden).float()
    return out


@torch.no_grad()
def current_logprobs(lm: PackedLM, batch: PackedBatch, fused: bool, temperature: float,
                     hidden: torch.Tensor) -> torch.Tensor:
    """[N] the policy's log-probs at the loss positions (0 elsewhere) from final
    hidden states already computed (one LM-head pass over the loss rows only,
    no decoder pass): the trainer's side of the engine/trainer agreement."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    out[batch.loss_mask] = token_logprobs(lm, batch, fused, temperature, hidden.detach()).float()
    return out


def rl_loss(lm: PackedLM, batch: PackedBatch, settings: RLLossSettings, fused: bool,
            entropy: bool = True, hidden: torch.Tensor | None = None,
            token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO loss with k3 KL to `batch.ref_logp` (when beta > 0).

    `batch.old_logp` None means the rollouts came from the current weights
    (one update per rollout batch): ratio 1, gradient -A, as in GRPO.
    `token_weights` [N] multiplies each token's loss (truncated importance
    sampling; no gradient).
    """
    if batch.advantages is None:
        raise ValueError("attach group advantages to the batch before the loss")
    ref = batch.ref_logp if settings.beta > 0 else None
    common = dict(
        old_logp=batch.old_logp, ref_logp=ref, eps_low=settings.eps_low, eps_high=settings.eps_high,
        beta=settings.beta, loss_type=settings.loss_type, token_weights=token_weights,
    )
    hidden = lm.hidden_states(batch) if hidden is None else hidden
    if fused:
        return kernels.fused_linear_grpo_loss(
            hidden, lm.lm_head_weight(), batch.targets, batch.advantages, batch.loss_mask, batch.cu_seqlens,
            temperature=settings.temperature, max_tokens=settings.max_tokens,
            compute_entropy=entropy, **common,
        )
    logits = lm.logits(hidden).float() / settings.temperature
    logp = kernels.token_logprobs(logits, batch.targets, 1.0, impl="reference")
    loss, stats = kernels.grpo_loss(
        logp, batch.old_logp, ref, batch.advantages, batch.loss_mask, batch.cu_seqlens,
        eps_low=settings.eps_low, eps_high=settings.eps_high, beta=settings.beta,
        loss_type=settings.loss_type, max_tokens=settings.max_tokens, token_weights=token_weights,
        impl="reference",
    )
    if entropy:
        with torch.no_grad():
            masked = logits[batch.loss_mask]
            p = masked.softmax(-1)
            stats = dict(stats, entropy=-(p * masked.log_softmax(-1)).sum(-1).mean()
                         if masked.numel() else torch.zeros(()))
    return loss, stats
