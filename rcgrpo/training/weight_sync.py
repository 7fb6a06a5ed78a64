"""What the rollout engine loads after each update: the policy's weights under
the plain transformers names, one tensor at a time.

The trainer's model may be wrapped (LoRA adapters, FSDP shards); the engine
always holds the plain model. Everything that turns the training model into
that stream lives here, so every weight swap and every export goes through it.
"""
from __future__ import annotations

from typing import Iterator

import torch


def rollout_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the plain model, streamed so that a caller never
    needs all full tensors at once."""
    for name, param in model.named_parameters():
        yield name, param.detach()
