"""The RL stage's learning curve: sampled reward on a fixed sample of its
training prompts, measured with the policy's current weights."""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from rcgrpo.base import distributed
from rcgrpo.conditioning.reward_tokens import stage_saw_reward_tokens
from rcgrpo.evaluation.sampled_reward import reward_metrics, sampled_reward
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.rollout.agent_loop import RolloutConfig
from rcgrpo.rollout.engine import play_awake
from rcgrpo.run.metrics import log_line


def probe_seed(data_seed: int) -> int:
    """The sampled-reward probe's rollout seed: apart from every step's
    rollout seeds (data_seed * 100_003 + step). A probe replayed elsewhere
    with it (benchmarks/learning.py) plays the very rollouts the trainer's did."""
    return data_seed * 100_003 + 50_021


class RewardProbe:
    """The RL stage's learning curve: sampled reward on a fixed sample of its
    training prompts (rcgrpo.evaluation.sampled_reward), measured with the
    policy's current weights before the first step, every `grpo.eval_every`
    steps and after the last. Under each reward token for a policy trained
    with them (the gap high - low is the token's effect), else without one.
    The entries are a seeded choice of at most `grpo.eval_rollouts`
    training entries; the seeds are the same at every measurement."""

    def __init__(self, stage: str, policy: TrainablePolicy, engine, entries: Sequence, tokenizer, *,
                 rollouts: int, config: RolloutConfig, finetune_stage: str, seed: int):
        """`rollouts`: grpo.eval_rollouts; `config`: the stage's rollout
        settings (rollout_settings); `seed`: data.seed."""
        self.stage, self.policy, self.engine, self.tokenizer = stage, policy, engine, tokenizer
        self.rollouts = rollouts
        n = min(len(entries), rollouts)
        self.entries = [entries[i] for i in sorted(random.Random(seed).sample(range(len(entries)), n))]
        self.conditionings = ("high", "low") if stage_saw_reward_tokens(stage, finetune_stage) else ("none",)
        self.config = dataclasses.replace(config, seed=probe_seed(seed))

    def measure(self, step: int) -> dict[str, float]:
        """Every rank plays the same sample (its engine takes the weights: a
        collective under FSDP); rank 0 logs the result."""
        def play(live):
            return {c: sampled_reward(live, self.tokenizer, self.entries, c, self.rollouts, self.config)
                    for c in self.conditionings}

        rates, replays = play_awake(self.engine, self.policy.rollout_weights, play,
                                    f"[{self.stage}] the sampled-reward probe at step {step}", warn=log_line,
                                    replay=not distributed.active())
        if distributed.is_main():
            log_line(f"[{self.stage}] step {step}: sampled reward on {len(self.entries)} training prompts: "
                     + "; ".join(f"{c} {r}" for c, r in rates.items()))
        return {**reward_metrics(rates), "probe_engine_replays": replays}
