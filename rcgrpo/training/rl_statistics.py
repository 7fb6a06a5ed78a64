"""What an RL step logs of its rollouts and advantages: reward summaries
(overall, per reward token, the share of zero-variance groups), gathered
over every rank, and the spread of the advantages."""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from rcgrpo.base import distributed
from rcgrpo.conditioning.reward_tokens import short_name
from rcgrpo.model.packing import informative


def group_stats(rollouts) -> dict[str, float]:
    """Reward summaries, overall and per reward token, and the share of groups
    whose rewards are all equal (zero advantage: no gradient)."""
    by_group: dict[int, list[float]] = defaultdict(list)
    by_token: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        by_group[r.group].append(r.reward)
        by_token[short_name(r.reward_token)].append(r.reward)
    rewards = [r.reward for r in rollouts]
    out = {
        "reward_mean": sum(rewards) / len(rewards),
        "zero_var_frac": sum(not informative(v) for v in by_group.values()) / len(by_group),
        "valid_frac": sum(r.valid for r in rollouts) / len(rollouts),
        "r_state_mean": sum(r.r_state for r in rollouts) / len(rollouts),
        "r_action_mean": sum(r.r_action for r in rollouts) / len(rollouts),
    }
    for key, values in by_token.items():
        out[f"reward_mean_{key}"] = sum(values) / len(values)
        out[f"rollouts_{key}"] = len(values)
    return out


@dataclasses.dataclass(frozen=True)
class RolloutSummary:
    """What the step's statistics need of a rollout, small enough to gather."""
    group: int  # position of its prompt in the whole step
    reward: float
    reward_token: str | None
    valid: bool
    r_state: float
    r_action: float
    generated: int


def gather_summaries(rollouts, group_offset: int) -> list[RolloutSummary]:
    """Every rank's rollouts of the step, in step order (one process's list)."""
    mine = [RolloutSummary(group_offset + r.group, r.reward, r.reward_token, r.valid, r.r_state, r.r_action,
                           sum(r.sampled_mask)) for r in rollouts]
    return [s for part in distributed.all_gather_objects(mine) for s in part]


def advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    """The spread of the step's advantages: every rank's, in rank order (as
    one process would hold them)."""
    adv = torch.tensor(sum(distributed.all_gather_objects(advantages.tolist()), []), dtype=torch.float32)
    return {"adv_std": float(adv.std(unbiased=False)) if adv.numel() > 1 else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0}
