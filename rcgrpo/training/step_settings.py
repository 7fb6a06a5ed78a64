"""What every training step reads of the run, read from the config once per
stage (beside the per-consumer settings: ``RLLossSettings``, ``UpdateSettings``,
``RolloutConfig``): the steps take it instead of the run's config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rcgrpo.training.losses import LossPath, loss_path


@dataclass(frozen=True)
class StepSettings:
    """How a stage's steps run.

    device: where the packed batches go (the policy's).
    path: the loss path (`run.fused`: "fused" or "reference").
    micro_batch_tokens: the tokens a forward computes at most (`run.micro_batch_tokens`).
    parity_check_every: the tree parity cadence after the stage's first check (0: once).
    checkpoint_every: a checkpoint every this many steps (0: none before the end).
    seed: the data seed (`data.seed`): the stage's data order and mini-batch shuffles.
    """
    device: torch.device
    path: LossPath
    micro_batch_tokens: int
    parity_check_every: int = 0
    checkpoint_every: int = 0
    seed: int = 0

    @classmethod
    def from_config(cls, cfg, device: torch.device) -> "StepSettings":
        return cls(device, loss_path(cfg.run.fused), cfg.run.micro_batch_tokens, cfg.model.parity_check_every,
                   cfg.run.checkpoint_every, cfg.data.seed)
