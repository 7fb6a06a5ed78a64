"""The group advantage estimators: how the rewards of a group of rollouts of
one prompt become each rollout's advantage. The one home of their names.

Every estimator is ``A_i = k * (R_i - mean_g) / d`` over the members of the
group ``g`` of rollout i (n members), from three facts an estimator states:

- ``scale_by_std``: d = std_g + eps, else d = 1;
- ``ddof``: the std's delta degrees of freedom, sqrt(sum (R - mean)^2 / (n - ddof));
- ``leave_one_out``: k = n / (n - 1), which turns R_i - mean_g into
  R_i - mean of the *other* members (RLOO); else k = 1.

=============  ===============================  ========================================
name           formula                          peers
=============  ===============================  ========================================
grpo           (R - mean) / (std + eps), ddof 0  the paper (default); DeepSeekMath GRPO
grpo_ddof1     (R - mean) / (std + eps), ddof 1  verl ``grpo`` (torch.std); TRL
                                                 ``scale_rewards="group"`` (TRL's eps 1e-4)
dr_grpo        R - mean                          Dr. GRPO; verl ``norm_adv_by_std_in_grpo=False``;
                                                 TRL ``scale_rewards="none"``
rloo           R - mean of the others            verl ``rloo``; TRL's RLOOTrainer
=============  ===============================  ========================================

A group whose rewards are all equal, and a group of one, get advantages of
exactly 0 under every estimator (verl gives a group of one its raw reward:
mean 0, std 1). ``"group"`` and ``"none"``, the values of the former
``scale`` argument, are accepted as the names of ``grpo`` and ``dr_grpo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = ["AdvantageEstimator", "ADVANTAGE_ESTIMATORS", "get_advantage_estimator"]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    scale_by_std: bool
    ddof: int = 0
    leave_one_out: bool = False
    description: str = ""

    def __post_init__(self):
        if self.ddof not in (0, 1):
            raise ValueError(f"advantage estimator {self.name!r}: ddof must be 0 or 1")


_REGISTRY: dict[str, AdvantageEstimator] = {}
ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageEstimator] = MappingProxyType(_REGISTRY)
# The former ``scale=`` values, kept so that earlier code and saved configs still work.
ALIASES = MappingProxyType({"group": "grpo", "none": "dr_grpo"})


def register_advantage_estimator(est: AdvantageEstimator) -> AdvantageEstimator:
    """Add an estimator under its name (a name is registered once)."""
    if est.name in _REGISTRY or est.name in ALIASES:
        raise ValueError(f"advantage estimator {est.name!r} is already registered")
    _REGISTRY[est.name] = est
    return est


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator called ``name`` (or one of its ALIASES); a
    ValueError listing the names otherwise."""
    try:
        return _REGISTRY[ALIASES.get(name, name)]
    except (KeyError, TypeError):
        raise ValueError(f"advantage estimator must be one of {tuple(_REGISTRY)}, got {name!r}") from None


register_advantage_estimator(AdvantageEstimator(
    "grpo", True, 0, description="(R - mean) / (std + eps), population std (the paper)"))
register_advantage_estimator(AdvantageEstimator(
    "grpo_ddof1", True, 1, description="(R - mean) / (std + eps), sample std (verl, TRL)"))
register_advantage_estimator(AdvantageEstimator("dr_grpo", False, description="R - mean (Dr. GRPO)"))
register_advantage_estimator(AdvantageEstimator(
    "rloo", False, leave_one_out=True, description="R - mean of the other members (RLOO)"))
