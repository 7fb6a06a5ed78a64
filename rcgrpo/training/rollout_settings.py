"""The rollout settings each stage plays with, read from the config in one place."""
from __future__ import annotations

import dataclasses

from rcgrpo.base.stages import RL_STAGES
from rcgrpo.config import Config
from rcgrpo.rollout.agent_loop import RolloutConfig


def rollout_settings(cfg: Config, stage: str, **overrides) -> RolloutConfig:
    """The rollout settings of `stage`, read from the config in this one
    place: an RL stage samples at `grpo.temperature` / `grpo.top_p`; eval
    plays greedily (or at `grpo.temperature`) up to `eval.max_new_tokens` a
    reply; rctp-data samples the starting model's failures at
    `rctp.failure_temperature`, and sft's expert data is cut to the same
    token budgets. `overrides`: what one call varies (an RL step's seeds and
    weights version, the loss's temperature)."""
    common = {"seed": cfg.data.seed, "doc_style": cfg.data.doc_style, "max_total_tokens": cfg.grpo.max_total_tokens}
    if stage in RL_STAGES:
        settings = RolloutConfig(max_new_tokens=cfg.grpo.max_new_tokens, temperature=cfg.grpo.temperature,
                                 top_p=cfg.grpo.top_p, progress=False, **common)
    elif stage == "eval":
        settings = RolloutConfig(max_new_tokens=cfg.eval.max_new_tokens,
                                 temperature=0.0 if cfg.eval.greedy else cfg.grpo.temperature, **common)
    else:
        settings = RolloutConfig(max_new_tokens=cfg.grpo.max_new_tokens, temperature=cfg.rctp.failure_temperature,
                                 progress=True, **common)
    return dataclasses.replace(settings, **overrides)
