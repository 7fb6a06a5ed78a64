"""Where a failure parts from its entry's expert: the first divergent token.

An entry's expert record (tagged `<|high_reward|>`) and a failure record of
the same entry (tagged `<|low_reward|>`) share their prompt but for the tag,
and often the start of the reply. Up to their first divergent token both
records teach the same content; the token there is the decision the reward
token has to steer, and it is the only place where a policy needs the tag to
predict either record. Two uses:

* the `late_divergence` failure source (rcgrpo.data.rctp) keeps rollouts
  whose first divergence comes at least `rctp.min_divergence_tokens`
  generated tokens into the reply;
* the steer probe (rcgrpo.training.steer) measures, at that token, how much
  more likely the expert's choice is under the high tag than under the low.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD

__all__ = ["Divergence", "first_divergence", "divergences"]


@dataclass(frozen=True)
class Divergence:
    """The first divergent token of one (expert, failure) pair."""

    entry_id: str
    prefix: tuple[int, ...]  # the expert record's ids before the divergent token, its tag included
    tag_at: int  # index of the reward token in `prefix`
    expert_token: int
    failure_token: int
    reply_offset: int  # tokens the expert generated before the divergent one


def first_divergence(expert, failure) -> Divergence | None:
    """The pair's first divergent token, or None when there is none to steer:
    the records carry the same tag, or they part outside a generated token
    (one stops where the other goes on, or at a tool result).

    `expert` and `failure` are `rcgrpo.data.rctp.Record`s of one entry. Their
    first difference is the tag (a prompt token); the next is the divergence.
    """
    e, f = expert.token_ids, failure.token_ids
    differing = (i for i in range(min(len(e), len(f))) if e[i] != f[i])
    tag = next(differing, None)
    if tag is None or expert.sampled_mask[tag] or failure.sampled_mask[tag]:
        return None
    j = next(differing, None)
    if j is None or not (expert.sampled_mask[j] and failure.sampled_mask[j]):
        return None
    return Divergence(expert.entry_id, tuple(e[:j]), tag, e[j], f[j], sum(expert.sampled_mask[:j]))


def divergences(records: Sequence) -> list[Divergence]:
    """Every low-tagged record against its entry's high-tagged expert, in
    record order; pairs without a divergent token are left out."""
    experts = {r.entry_id: r for r in records if r.kind == "expert" and r.reward_token == HIGH_REWARD}
    out = []
    for r in records:
        if r.reward_token == LOW_REWARD and r.entry_id in experts:
            d = first_divergence(experts[r.entry_id], r)
            if d is not None:
                out.append(d)
    return out
