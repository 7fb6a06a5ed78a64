"""The optimizer of every training stage: AdamW over the policy's fp32 master
weights (so its two moments are fp32 too), a linear warm-up to a constant
rate, and the clipped step."""
from __future__ import annotations

import torch

from rcgrpo.base import distributed
from rcgrpo.model.policy import TrainablePolicy


def make_optimizer(policy: TrainablePolicy, lr: float, weight_decay: float, total_steps: int, warmup_ratio: float):
    """AdamW (the paper's optimizer for SFT; our choice for the RL stages) and
    a linear warm-up to a constant rate."""
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def clip_and_step(policy: TrainablePolicy, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip to the global gradient norm (0: no clipping) and step; returns the
    norm before clipping. With FSDP the gradients are DTensor shards: torch's
    norm of them is the norm over all ranks (the same number on every rank),
    returned as a DTensor and read out whole."""
    params = [p for p in policy.trainable_parameters() if p.grad is not None]
    if not params:
        norm = torch.zeros(())
    elif max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = distributed.full_tensor(norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    policy.equals_reference = False
    return float(norm)
