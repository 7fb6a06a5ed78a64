"""The loss types: how the per-token GRPO losses of a packed batch are reduced
to one number. The one home of their names and their definitions.

Every reduction is ``loss = sum_i l_i / d(seq(i))`` over the loss tokens, with
a per-sequence denominator ``d`` built from three facts a ``LossType`` states:

- ``normaliser``: the count the batch's loss divides by (sequences with loss
  tokens, loss tokens, or sequences), or None for a sum. Gradient
  accumulation splits a batch by the ratio of these counts
  (``rcgrpo.batch.accumulation_weight``; a sum's parts each weigh 1).
- ``mean_within_sequence``: each sequence's tokens are averaged first (the
  denominator also holds that sequence's loss-token count).
- ``scaled_by_max_tokens``: the denominator also holds a constant token budget
  (Dr. GRPO: ``max_tokens``, by default the longest sequence's count).

The chunked and Triton paths need only ``sequence_weights`` (``1 / d`` per
sequence), so a registered type runs on every path; ``rcgrpo_kernels.reference``
reduces with a loop over sequences from the same three facts.

The built-in types and what peers call them (l_i the per-token loss, n_s
the loss tokens of sequence s, S+ the sequences with at least one, S all
sequences, T the ``max_tokens`` constant):

=======================  ==========================  ==================================  ==================
name                     loss                        verl ``loss_agg_mode``              TRL ``loss_type``
=======================  ==========================  ==================================  ==================
grpo                     mean over S+ of             ``seq-mean-token-mean``             ``grpo`` (*)
                         (sum_s l / n_s)
bnpo                     sum l / sum n_s             ``token-mean`` (one process)        ``bnpo``
dapo                     sum l / sum n_s             ``token-mean`` (global count)       ``dapo`` (**)
dr_grpo                  sum l / (S T)               --                                  ``dr_grpo`` with
                                                                                         T = max_completion_length
token-sum                sum l                       --                                  --
seq-mean-token-sum       sum l / |S+|                ``seq-mean-token-sum``              --
seq-mean-token-sum-norm  sum l / T                   ``seq-mean-token-sum-norm`` with    --
                                                     T = ``loss_scale_factor`` (***)
=======================  ==========================  ==================================  ==================

(*) TRL's grpo averages over *all* sequences, a sequence without loss
tokens adding 0 (``mask.sum(-1).clamp(min=1)``); ours leaves such a
sequence out, as verl does. They agree whenever every sequence has a loss
token (every completion has at least one token). (**) TRL's and verl's
global counts span processes and accumulation steps; rcgrpo's accumulation
(``rcgrpo.batch.accumulation_weight``) divides by the whole batch's count,
which is the same on one process. (***) verl's default T is the padded
response length of the micro-batch; pass ``max_tokens`` to fix it. With T
defaulting here to the longest sequence's loss-token count, dr_grpo is
``seq-mean-token-sum-norm`` divided by S.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch

__all__ = ["LossType", "LOSS_TYPES", "get_loss_type", "register_loss_type", "sequence_weights"]


@dataclass(frozen=True)
class LossType:
    """One reduction. ``normaliser(counts, keep)`` maps the [S] per-sequence
    loss-token counts and an [S] bool selection to the count (a 0-d tensor)
    the loss divides by; the selection is how a caller counts a subset
    (``rcgrpo.batch.loss_normaliser(..., informative_only=True)``)."""

    name: str
    normaliser: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    mean_within_sequence: bool = False
    scaled_by_max_tokens: bool = False
    description: str = ""

    def __post_init__(self):
        if self.mean_within_sequence and self.scaled_by_max_tokens:
            # sequence_weights builds a denominator of two factors, not three.
            raise ValueError(f"loss_type {self.name!r}: choose one of mean_within_sequence and scaled_by_max_tokens")

    @property
    def divides(self) -> bool:
        """False for a sum (``normaliser`` None): each micro-batch's or rank's
        loss is then its own share, with an accumulation weight of 1."""
        return self.normaliser is not None

    def count(self, counts: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The normaliser of the sequences ``keep`` selects (all by default); 1 for a sum."""
        if self.normaliser is None:
            return torch.ones((), dtype=torch.long, device=counts.device)
        if keep is None:
            keep = torch.ones_like(counts, dtype=torch.bool)
        return self.normaliser(counts, keep)


_REGISTRY: dict[str, LossType] = {}
# A read-only view in registration order: ``tuple(LOSS_TYPES)`` are the names.
LOSS_TYPES: Mapping[str, LossType] = MappingProxyType(_REGISTRY)


def register_loss_type(loss_type: LossType) -> LossType:
    """Add a reduction under its name (a name is registered once)."""
    if loss_type.name in _REGISTRY:
        raise ValueError(f"loss_type {loss_type.name!r} is already registered")
    _REGISTRY[loss_type.name] = loss_type
    return loss_type


def get_loss_type(name: str) -> LossType:
    """The registered reduction called ``name``; a ValueError listing the
    names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"loss_type must be one of {tuple(_REGISTRY)}, got {name!r}") from None


def sequence_weights(counts: torch.Tensor, loss_type: str, max_tokens: Optional[float] = None) -> torch.Tensor:
    """[S] fp32 weight ``1 / d`` of one loss token of each sequence (0 for a
    sequence the reduction leaves out). Kept as tensors, so no host sync.

    Every denominator is one product of at most two factors, so the weights
    are the same bits whichever factor a type adds.
    """
    lt = get_loss_type(loss_type)
    c = counts.to(torch.float32)
    num_seqs = counts.numel()
    # A batch without a counted sequence or token has nothing to divide: 1
    # keeps every weight finite (and the loss is 0 there anyway).
    denominator = lt.count(counts).to(torch.float32).clamp(min=1.0)
    if lt.mean_within_sequence:
        denominator = c.clamp(min=1.0) * denominator
    elif lt.scaled_by_max_tokens:
        if max_tokens is None:
            budget = c.max().clamp(min=1.0) if num_seqs > 0 else c.new_tensor(1.0)
        else:
            budget = c.new_tensor(float(max_tokens))
        denominator = budget * denominator
    weights = (1.0 / denominator).expand(num_seqs).contiguous()
    if lt.mean_within_sequence:
        # A sequence without loss tokens has no mean to take part in.
        weights = torch.where(counts > 0, weights, torch.zeros_like(weights))
    return weights


# The three counts the built-in reductions divide by.
def sequences_with_loss_tokens(counts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return ((counts > 0) & keep).sum()


def loss_tokens(counts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, counts, torch.zeros_like(counts)).sum()


def sequences(counts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return keep.sum()


register_loss_type(LossType(
    "grpo", sequences_with_loss_tokens, mean_within_sequence=True,
    description="mean over sequences (with loss tokens) of each sequence's token mean (GRPO paper)"))
register_loss_type(LossType("bnpo", loss_tokens, description="token mean over the batch"))
register_loss_type(LossType(
    "dapo", loss_tokens, description="token mean over the batch (DAPO; the same as bnpo on one process)"))
register_loss_type(LossType(
    "dr_grpo", sequences, scaled_by_max_tokens=True,
    description="sum over tokens / (sequences x max_tokens) (Dr. GRPO)"))
register_loss_type(LossType("token-sum", None, description="sum over the loss tokens"))
register_loss_type(LossType(
    "seq-mean-token-sum", sequences_with_loss_tokens,
    description="each sequence's token sum, averaged over the sequences with loss tokens (verl)"))
register_loss_type(LossType(
    "seq-mean-token-sum-norm", None, scaled_by_max_tokens=True,
    description="sum over the loss tokens / max_tokens (verl, with max_tokens = its loss_scale_factor)"))
