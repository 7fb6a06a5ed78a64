"""Moved: the TRL drop-in is now installed with the kernels as
`rcgrpo_kernels.trl_grpo` (`from rcgrpo_kernels.trl_grpo import
KernelGRPOTrainer`). This file keeps the old import path, and copies of it,
working for one release."""
import warnings

from rcgrpo_kernels.trl_grpo import SUPPORTED_LOSS_TYPES, KernelGRPOTrainer, unsupported_settings  # noqa: F401

warnings.warn("integrations.trl_grpo moved to rcgrpo_kernels.trl_grpo; import KernelGRPOTrainer from there",
              DeprecationWarning, stacklevel=2)
