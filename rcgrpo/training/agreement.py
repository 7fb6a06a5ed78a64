"""Engine vs trainer: how far the log-probs the rollout engine reported while
sampling are from the trainer's for the same tokens (`Agreement`, logged
every RL step), and truncated importance sampling's per-token weights, which
correct the loss for that gap (`tis_weights`, with `grpo.tis_cap`)."""
from __future__ import annotations

import math

import torch

import rcgrpo_kernels
from rcgrpo.base import distributed
from rcgrpo.model.packing import PackedBatch


class Agreement:
    """Engine vs trainer log-probs over loss tokens: sums per micro-batch,
    reduced over micro-batches and ranks at the end (`summary`)."""

    THRESHOLD = 0.1  # nats: the share of tokens further apart than this is logged

    def __init__(self):
        # Every key from the start: a rank without loss tokens still takes
        # part in the same reduction as the others.
        self.sums = dict.fromkeys(("tokens", "abs", "over", "tis_weight", "tis_capped"), 0.0)
        self.seq_log_ratios: list[float] = []

    def add(self, batch: PackedBatch, trainer_logp: torch.Tensor, tis_cap: float | None = None) -> None:
        if batch.engine_logp is None or not batch.num_loss_tokens:
            return
        mask = batch.loss_mask
        diff = (trainer_logp - batch.engine_logp)[mask].double()
        self.sums["tokens"] += diff.numel()
        self.sums["abs"] += float(diff.abs().sum())
        self.sums["over"] += float((diff.abs() > self.THRESHOLD).sum())
        # log pi_trainer(seq) / pi_engine(seq) = the sum of its tokens' differences
        seq = rcgrpo_kernels.packing.sequence_ids(torch.nonzero(mask).reshape(-1), batch.cu_seqlens)
        per_seq = torch.zeros(batch.num_seqs, dtype=torch.float64, device=diff.device).index_add_(0, seq, diff)
        has = rcgrpo_kernels.packing.loss_token_counts(mask, batch.cu_seqlens) > 0
        self.seq_log_ratios.extend(per_seq[has].tolist())
        if tis_cap is not None:
            self.sums["tis_weight"] += float(torch.exp(diff).clamp(max=tis_cap).sum())
            self.sums["tis_capped"] += float((diff > math.log(tis_cap)).sum())

    def summary(self, tis: bool) -> dict[str, float]:
        sums = distributed.all_reduce_sum(dict(self.sums))
        ratios = [x for part in distributed.all_gather_objects(self.seq_log_ratios) for x in part]
        tokens = sums.get("tokens", 0.0)
        if not tokens:
            return {}
        out = {
            "logp_diff_abs_mean": sums["abs"] / tokens,
            "logp_diff_over_0.1_frac": sums["over"] / tokens,
            "seq_log_ratio_mean": sum(ratios) / len(ratios),
            "seq_log_ratio_abs_max": max(abs(x) for x in ratios),
        }
        if tis:
            out["tis_weight_mean"] = sums["tis_weight"] / tokens
            out["tis_capped_frac"] = sums["tis_capped"] / tokens
        return out


def tis_weights(trainer_old: torch.Tensor, engine_logp: torch.Tensor, cap: float, mask: torch.Tensor) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): min(pi_old / pi_engine,
    cap) per loss token, 1 elsewhere; a constant of the loss."""
    w = torch.exp(trainer_old - engine_logp).clamp(max=cap)
    return torch.where(mask, w, torch.ones_like(w)).detach()
