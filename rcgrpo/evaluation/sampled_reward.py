"""Sampled reward on a fixed set of prompts: the learning curve's measure.

A training stage's per-step reward is measured on that step's few prompts,
with the weights of the moment and fresh seeds, so it is noisy and drifts
with the schedule. This measure is the same sample every time: each of the
given entries played `ceil(rollouts / entries)` times under one reward token
(or none), at the rollout temperature, with the same seeds at every call,
so that two measurements differ only by the weights (common random numbers).
Rewards are binary: the result is a success rate with its 95% Wilson
interval (rcgrpo.evaluation.stats).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from rcgrpo.conditioning.reward_tokens import token_named
from rcgrpo.evaluation.stats import Rate, rate
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes

__all__ = ["sampled_reward", "reward_metrics"]


def sampled_reward(engine, tokenizer, entries: Sequence, conditioning: str, rollouts: int,
                   config: RolloutConfig) -> Rate:
    """The success rate of at least `rollouts` sampled rollouts of `entries`
    (each played equally often) under `conditioning` ("high", "low" or
    "none"), with `config`'s sampling settings and seed."""
    per_entry = max(1, math.ceil(rollouts / len(entries)))
    played = run_episodes(engine, tokenizer, list(entries), group_size=per_entry,
                          config=dataclasses.replace(config, progress=False), reward_tokens=token_named(conditioning))
    return rate([r.reward for r in played])


def reward_metrics(rates: dict[str, Rate]) -> dict[str, float]:
    """Metric keys for {conditioning: Rate}: sampled_reward_<name> and its
    interval's _lo / _hi, and the rollouts it took (_n)."""
    out: dict[str, float] = {}
    for name, r in rates.items():
        lo, hi = r.ci
        out.update({f"sampled_reward_{name}": r.mean, f"sampled_reward_{name}_lo": lo,
                    f"sampled_reward_{name}_hi": hi, f"sampled_reward_{name}_n": r.n})
    return out
