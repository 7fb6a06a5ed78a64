"""The settings of one fused-linear GRPO loss call, checked once.

``dispatch.fused_linear_grpo_loss`` keeps its long keyword signature for its
users and builds a ``LossSettings`` from it; the implementations (reference,
chunked, Triton) take that one object, so a new setting is added here and in
the public signature, not in four parameter lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .loss_types import get_loss_type
from .objective import Objective, finite_number

__all__ = ["LossSettings"]


@dataclass(frozen=True)
class LossSettings:
    """objective: the per-token objective (clip range, beta, dual clip, KL
    estimator, clamps; ``objective.py``). loss_type: a name in
    ``rcgrpo_kernels.LOSS_TYPES``, the reduction. max_tokens: the constant of
    the types scaled by a token budget (None: the batch's longest sequence).
    temperature: divides the logits. compute_entropy: also report the mean
    entropy over the loss tokens."""

    objective: Objective = field(default_factory=Objective)
    loss_type: str = "grpo"
    max_tokens: Optional[float] = None
    temperature: float = 1.0
    compute_entropy: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        get_loss_type(self.loss_type)
        if self.max_tokens is not None:
            # Checked, but kept as given: the reductions convert it themselves.
            finite_number("max_tokens", self.max_tokens, 0.0, strict=True)
        set_(self, "temperature", finite_number("temperature", self.temperature, 0.0, strict=True))
        set_(self, "compute_entropy", bool(self.compute_entropy))

    def stat_keys(self, has_ref: bool) -> list[str]:
        """The statistics the loss returns, in the order of its outputs
        (``Objective.stat_keys``, with ``entropy`` when asked)."""
        return self.objective.stat_keys(has_ref, self.compute_entropy)
