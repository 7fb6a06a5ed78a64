"""What the rollout engine loads after each update: the policy's weights under
the plain transformers names, one tensor at a time.

The trainer's model may be wrapped (LoRA adapters, FSDP shards); the engine
always holds the plain model. Everything that turns the training model into
that stream lives here, so every weight swap and every export goes through it.
"""
from __future__ import annotations

from typing import Iterator

import torch

from rcgrpo.distributed import full_tensor
from rcgrpo.lora import is_lora, merged_weights


def rollout_weights(model: torch.nn.Module, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the plain model, streamed so that a caller never
    needs all full tensors at once.

    A LoRA (peft) model is folded on the way: its own full tensors stream
    through `rcgrpo.lora.merged_weights`, which yields W + delta per layer
    under the plain names. `merge_lora=False` is that raw stream."""
    if merge_lora and is_lora(model):
        yield from merged_weights(model, rollout_weights(model, merge_lora=False))
        return
    # FSDP shards (DTensors) are gathered one parameter at a time: never the
    # whole model on a rank at once. full_tensor() is a collective, so every
    # rank walks the parameters in the same order and consumes the stream.
    for name, param in model.named_parameters():
        yield name, full_tensor(param.detach())
