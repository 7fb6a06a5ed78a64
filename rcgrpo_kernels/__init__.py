"""Kernels for packed GRPO: token log-probs, group advantages, the clipped loss.

Standalone: depends on torch (and triton, for CUDA tensors) only, so other
GRPO code can import it without rcgrpo. Each function runs one of three
implementations, chosen by the tensors' device or forced with ``impl=``:
"reference" (plain PyTorch, the oracle), "chunked" (PyTorch chunked over
tokens, the CPU path) and "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
The packed-batch conventions are documented in ``rcgrpo_kernels.dispatch``.

The names a loss is configured by each have one home, a registry every path
reads: ``LOSS_TYPES`` (reductions, with verl's and TRL's names,
``loss_types.py``), ``KL_ESTIMATORS`` (``kl_estimators.py``),
``ADVANTAGE_ESTIMATORS`` (``advantage_estimators.py``); the per-token
objective and its settings (clip range, dual clip, clamps) are
``objective.py``; all the settings of one fused-linear loss call travel to
its implementations as one ``LossSettings`` (``loss_settings.py``).
"""

from .advantage_estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    get_advantage_estimator,
    register_advantage_estimator,
)
from .dispatch import (
    fused_linear_grpo_loss,
    fused_linear_logprobs,
    group_advantages,
    grpo_loss,
    token_logprobs,
)
from .kl_estimators import KL_ESTIMATORS, KLEstimator, get_kl_estimator
from .loss_types import LOSS_TYPES, LossType, get_loss_type, register_loss_type
from .objective import Objective
from .packing import next_token_targets

__all__ = [
    "token_logprobs",
    "fused_linear_logprobs",
    "group_advantages",
    "grpo_loss",
    "fused_linear_grpo_loss",
    "next_token_targets",
    "LOSS_TYPES",
    "LossType",
    "get_loss_type",
    "register_loss_type",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "get_advantage_estimator",
    "register_advantage_estimator",
    "KL_ESTIMATORS",
    "KLEstimator",
    "get_kl_estimator",
    "Objective",
]
