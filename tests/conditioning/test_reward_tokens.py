"""rcgrpo.conditioning.reward_tokens: the tokens' names and the rules that pick a prompt's token."""
import random

import pytest

from rcgrpo.conditioning.reward_tokens import (
    HIGH_REWARD,
    LOW_REWARD,
    DrawPerRollout,
    default_eval_conditioning,
    label_for_reward,
    rl_rollout_conditioning,
    rollout_tokens,
    short_name,
    stage_saw_reward_tokens,
    token_named,
)
from rcgrpo.config import PIPELINES, RL_STAGES, parse_args


def test_names_and_tokens_map_both_ways():
    for name in ("high", "low", "none"):
        assert short_name(token_named(name)) == name
    assert token_named("high") == HIGH_REWARD and token_named("none") is None
    with pytest.raises(ValueError, match="conditioning 'auto'"):
        token_named("auto")
    with pytest.raises(ValueError, match="not a reward token"):
        short_name("<|medium_reward|>")


def test_rctp_labels_follow_the_reward():
    assert label_for_reward(1.0) == HIGH_REWARD
    assert label_for_reward(0.99) == LOW_REWARD and label_for_reward(0.0) == LOW_REWARD


def test_rl_stages_condition_their_rollouts_as_the_paper_says():
    assert rl_rollout_conditioning("rc-grpo", "rctp", 0.3) == DrawPerRollout(0.3)
    assert rl_rollout_conditioning("rc-grpo", "sft", 0.5) == DrawPerRollout(0.5)
    assert rl_rollout_conditioning("grpo", "rctp", 0.5) == HIGH_REWARD
    assert rl_rollout_conditioning("grpo", "sft", 0.5) is None
    with pytest.raises(ValueError, match="not an RL stage"):
        rl_rollout_conditioning("sft", "sft", 0.5)


def test_a_grpo_policy_saw_the_tokens_exactly_when_its_rollouts_carried_one():
    for finetune_stage in ("rctp", "sft"):
        carried = rl_rollout_conditioning("grpo", finetune_stage, 0.5) is not None
        assert stage_saw_reward_tokens("grpo", finetune_stage) == carried


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_default_eval_conditioning_is_the_configs_auto(pipeline):
    cfg = parse_args(["--pipeline", pipeline], check_files=False)
    rl_stage = next(s for s in PIPELINES[pipeline] if s in RL_STAGES)
    assert default_eval_conditioning(cfg.finetune_stage, rl_stage) == cfg.eval.conditioning


def test_rollout_tokens_of_each_kind_of_conditioning():
    draw = DrawPerRollout(0.5)
    assert rollout_tokens(draw, 6, random.Random(3)) == draw.draw(6, random.Random(3))
    assert rollout_tokens(HIGH_REWARD, 3, random.Random(0)) == [HIGH_REWARD] * 3
    assert rollout_tokens(None, 2, random.Random(0)) == [None, None]
    assert rollout_tokens([LOW_REWARD, None], 2, random.Random(0)) == [LOW_REWARD, None]
    with pytest.raises(ValueError, match="2 reward tokens for 3 rollouts"):
        rollout_tokens([LOW_REWARD, None], 3, random.Random(0))
    with pytest.raises(ValueError, match="not a reward token: 'sample'"):
        rollout_tokens("sample", 3, random.Random(0))
