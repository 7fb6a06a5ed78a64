"""The two reward tokens, and which one a stage's prompts carry.

RC-GRPO conditions a rollout on a reward token appended to its first user
message (the paper, arXiv 2602.03025). This module is the one home of the
tokens (their strings, short names and the phrases their embedding rows start
from) and of the rules that decide which token a prompt gets:

* RCTP data: a trajectory is labelled by its own reward (`label_for_reward`).
* RL rollouts (`rl_rollout_conditioning`): RC-GRPO draws a token per rollout
  with P(high) = p_high; GRPO after RCTP conditions every rollout on the high
  token (what the RCTP policy is asked for at evaluation); GRPO after SFT uses
  none.
* Evaluation: whether a stage's policy ever saw the tokens
  (`stage_saw_reward_tokens`), the pipeline's default conditioning
  (`default_eval_conditioning`), and the token a conditioning name stands
  for (`token_named`).

Plain Python on purpose (no torch, no transformers): configuration, reports
and metrics import it cheaply.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, Union

from rcgrpo.base.stages import TRAINED_STAGES

__all__ = [
    "HIGH_REWARD", "LOW_REWARD", "REWARD_TOKENS", "REWARD_TOKEN_PHRASES", "CONDITIONING_NAMES",
    "DrawPerRollout", "Conditioning", "short_name", "token_named", "label_for_reward",
    "rollout_tokens", "rl_rollout_conditioning", "stage_saw_reward_tokens", "default_eval_conditioning",
]

HIGH_REWARD = "<|high_reward|>"
LOW_REWARD = "<|low_reward|>"
REWARD_TOKENS = (HIGH_REWARD, LOW_REWARD)
# Each reward token starts at the mean embedding row of what it means. Leading
# space: the tokens sit mid-sentence, so the phrase must map to mid-word pieces.
REWARD_TOKEN_PHRASES = {HIGH_REWARD: " high reward", LOW_REWARD: " low reward"}

# The names a person uses for a conditioning (`--conditioning`, eval.conditioning,
# metric keys such as reward_mean_high); "none" is a prompt without a token.
_TOKEN_OF_NAME = {"high": HIGH_REWARD, "low": LOW_REWARD, "none": None}
CONDITIONING_NAMES = tuple(_TOKEN_OF_NAME)
_NAME_OF_TOKEN = {token: name for name, token in _TOKEN_OF_NAME.items()}



def short_name(token: str | None) -> str:
    """"high", "low" or "none" (no token)."""
    try:
        return _NAME_OF_TOKEN[token]
    except KeyError:
        raise ValueError(f"not a reward token: {token!r}") from None


def token_named(name: str) -> str | None:
    """The token a conditioning name ("high", "low", "none") stands for."""
    try:
        return _TOKEN_OF_NAME[name]
    except KeyError:
        raise ValueError(f"conditioning {name!r}: one of {CONDITIONING_NAMES}") from None


def label_for_reward(reward: float, threshold: float = 1.0) -> str:
    """RCTP's label of a trajectory: high for a success (reward >= `threshold`:
    BFCL's full reward, an environment's env.success_threshold), low otherwise."""
    return HIGH_REWARD if reward >= threshold else LOW_REWARD


@dataclass(frozen=True)
class DrawPerRollout:
    """RC-GRPO's conditioning: every rollout draws its own token,
    <|high_reward|> with probability `p_high`, else <|low_reward|>."""

    p_high: float = 0.5

    def draw(self, n: int, rng: random.Random) -> list[str]:
        """r_j ~ P_sample, drawn independently per rollout."""
        return [HIGH_REWARD if rng.random() < self.p_high else LOW_REWARD for _ in range(n)]


# What the rollouts of one call are conditioned on: a draw per rollout, one
# token (or None) for all of them, or one token (or None) per rollout.
Conditioning = Union[DrawPerRollout, str, None, Sequence[Union[str, None]]]


def rollout_tokens(conditioning: Conditioning, n: int, rng: random.Random) -> list[str | None]:
    """One token (or None) for each of `n` rollouts; only a draw uses `rng`."""
    if isinstance(conditioning, DrawPerRollout):
        return conditioning.draw(n, rng)
    if conditioning is None or isinstance(conditioning, str):
        if conditioning is not None and conditioning not in REWARD_TOKENS:
            raise ValueError(f"not a reward token: {conditioning!r}")
        return [conditioning] * n
    tokens = list(conditioning)
    if len(tokens) != n:
        raise ValueError(f"{len(tokens)} reward tokens for {n} rollouts")
    return tokens


def rl_rollout_conditioning(stage: str, finetune_stage: str, p_high: float) -> DrawPerRollout | str | None:
    """What the rollouts of RL stage `stage` ("grpo" or "rc-grpo") are
    conditioned on, after the run's fine-tuning stage `finetune_stage`
    ("rctp" or "sft")."""
    if stage == "rc-grpo":
        return DrawPerRollout(p_high)
    if stage == "grpo":
        return HIGH_REWARD if finetune_stage == "rctp" else None
    raise ValueError(f"{stage!r} is not an RL stage (grpo or rc-grpo)")


def stage_saw_reward_tokens(stage: str, finetune_stage: str) -> bool:
    """Whether the policy that `stage` leaves was trained with reward tokens in
    its prompts, so that evaluating it under a token asks what it learnt.

    `finetune_stage` is the run's fine-tuning stage ("rctp" or "sft"). "rctp"
    and "rc-grpo" train on tagged prompts; "grpo" inherits the tokens only
    from an RCTP start (its rollouts carry the high token then,
    `rl_rollout_conditioning`); "sft", and "grpo" after sft, never saw them.
    Every exported folder's tokenizer holds the tokens regardless (rcgrpo adds
    them to any model), so the stage, not the tokenizer, decides. Raises
    ValueError for a name that is not a training stage.
    """
    if stage not in TRAINED_STAGES:
        raise ValueError(f"{stage!r} is not a training stage (one of {TRAINED_STAGES})")
    return stage in ("rctp", "rc-grpo") or (stage == "grpo" and finetune_stage == "rctp")


def default_eval_conditioning(finetune_stage: str, rl_stage: str) -> str:
    """eval.conditioning "auto" of a pipeline: "high" when its final policy was
    trained with reward tokens, else "none" (only SFT + GRPO never was)."""
    return "high" if stage_saw_reward_tokens(rl_stage, finetune_stage) else "none"
