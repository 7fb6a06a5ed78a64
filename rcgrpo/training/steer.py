"""The steer: how far the reward token moves the decision it is there for.

At the first token where an entry's expert record (tag `<|high_reward|>`)
and a failure record (tag `<|low_reward|>`) part (rcgrpo.data.divergence),
the policy is asked for the expert's token after the shared history under
each tag:

    steer          = log p(expert token | high) - log p(expert token | low)
    steer_logodds  = logit p(expert token | high) - logit p(expert token | low)

in nats, averaged over the pairs; `p_expert_high` / `p_expert_low` are the
two probabilities' means. 0 means the tag changes nothing there; RCTP is
meant to make it large. The log-odds form keeps growing once p(expert | high)
nears 1, where the plain difference stalls at -log p(expert | low).

It is measured teacher-forced, without sampling: one forward pass per pair
and tag of the expert's prefix, and the next-token distribution at its last
position. The two prefixes of a pair differ only at the tag, so with prefix
sharing their common system prompt is forwarded once.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

from rcgrpo.data.divergence import Divergence
from rcgrpo.model.micro_batching import micro_batch_plan
from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.policy import PackedLM

__all__ = ["STEER_METRICS", "probe_pairs", "steer"]

STEER_METRICS = ("steer", "steer_logodds", "p_expert_high", "p_expert_low", "steer_pairs")


def probe_pairs(pairs: Sequence[Divergence], limit: int, seed: int) -> list[Divergence]:
    """At most `limit` pairs, a seeded choice kept in the pairs' order (the
    same pairs at every step, so the curve follows one set)."""
    if len(pairs) <= limit:
        return list(pairs)
    keep = sorted(random.Random(seed).sample(range(len(pairs)), limit))
    return [pairs[i] for i in keep]


def _logit(logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) from log p, finite for p = 1 in fp64 rounding."""
    return logp - torch.log((-torch.expm1(logp)).clamp(min=1e-300))


@torch.no_grad()
def steer(lm: PackedLM, pairs: Sequence[Divergence], high_id: int, low_id: int,
          micro_batch_tokens: int) -> dict[str, float]:
    """The steer of `lm` (module docstring) over `pairs`; {} for no pairs.
    Call it with dropout off (the policy's eval mode)."""
    if not pairs:
        return {}
    sequences = []
    for d in pairs:
        for tag in (high_id, low_id):
            ids = list(d.prefix)
            ids[d.tag_at] = tag
            sequences.append(Trajectory(ids, [0] * len(ids)))
    batch = pack(sequences).to(lm.lm_head_weight().device)
    logp = torch.empty(batch.num_seqs, dtype=torch.float64)
    for ix in micro_batch_plan(batch, micro_batch_tokens, lm.shares_prefixes):
        micro = batch.select(ix)
        hidden = lm.hidden_states(micro)[micro.cu_seqlens[1:].long() - 1]
        rows = lm.logits(hidden).float().log_softmax(-1).double().cpu()
        targets = torch.tensor([pairs[s // 2].expert_token for s in ix])
        logp[ix] = rows.gather(1, targets[:, None])[:, 0]
    high, low = logp[0::2], logp[1::2]
    return {"steer": float((high - low).mean()), "steer_logodds": float((_logit(high) - _logit(low)).mean()),
            "p_expert_high": float(high.exp().mean()), "p_expert_low": float(low.exp().mean()),
            "steer_pairs": len(pairs)}
