"""Ranks take the same number of forward/backward passes per optimizer step.

Under FSDP every forward all-gathers each layer's parameters and every
backward reduce-scatters its gradients: collectives that pair up pass by
pass across ranks. Ranks hold different trajectories, so their micro-batch
counts differ (or a rank holds none when the batch is smaller than the
world); the ones with fewer passes pad with a tiny zero-weight batch that
touches every parameter like a real one, and contributes nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import torch

from rcgrpo.base import distributed
from rcgrpo.model.packing import PackedBatch, Trajectory, pack


def padding_batch(device: torch.device) -> PackedBatch:
    """One two-token sequence with one loss token and a zero advantage: the
    losses stay finite (nothing is divided by zero) and the LM head is used,
    so every parameter gets a (zero) gradient, as on the other ranks."""
    batch = pack([Trajectory([0, 0], [0, 1], group=0, reward=0.0)]).to(device)
    return dataclasses.replace(batch, advantages=torch.zeros(1, device=device))


def lockstep(micros: Sequence[PackedBatch], device: torch.device) -> Iterator[tuple[PackedBatch, bool]]:
    """(micro-batch, is_padding) for as many passes as the busiest rank takes."""
    passes = distributed.all_reduce_max(len(micros))
    for i in range(passes):
        if i < len(micros):
            yield micros[i], False
        else:
            yield padding_batch(device), True
