"""Supervised fine-tuning on trajectories: the SFT baseline (expert only) and
RCTP (expert + failure, reward-token tagged). Loss only on the tokens the
policy generates (assistant turns), packed micro-batches, AdamW."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

from rcgrpo.base import distributed
from rcgrpo.data.divergence import Divergence
from rcgrpo.model.micro_batching import micro_batches
from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.training.lockstep import lockstep
from rcgrpo.training.losses import sft_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from rcgrpo.training.parity import ParityOracle
from rcgrpo.training.stage_loop import StageRun, StageSteps, run_stage
from rcgrpo.training.stage_verdict import FINETUNE_FIGURES
from rcgrpo.training.steer import steer
from rcgrpo.training.step_settings import StepSettings


def epoch_order(n: int, epochs: int, seed: int) -> list[int]:
    """Trajectory indices for all epochs, each epoch reshuffled from the seed."""
    order = []
    for epoch in range(epochs):
        idx = list(range(n))
        random.Random(seed * 1_000 + epoch).shuffle(idx)
        order.extend(idx)
    return order


@dataclass(frozen=True)
class SFTStepResult:
    """One step's figures: the mean NLL over every rank's loss tokens, their
    count, the packed tokens, the gradient norm, and the parity figures."""
    loss: float
    loss_tokens: int
    batch_tokens: int
    grad_norm: float
    checked: dict


def sft_step(policy: TrainablePolicy, chunk: Sequence[Trajectory], how: StepSettings, parity: ParityOracle,
             step: int, optimizer, scheduler, max_grad_norm: float) -> SFTStepResult:
    """One optimizer step on `chunk`, the step's trajectories. Under torchrun
    each rank trains on its slice of them, weighted by the loss-token count
    over all ranks."""
    lo, hi = distributed.rank_slice(chunk)
    full = pack(chunk[lo:hi]).to(how.device) if hi > lo else None
    micros = [] if full is None else micro_batches(full, how.micro_batch_tokens, policy.lm.shares_prefixes)
    counts = distributed.all_reduce_sum(
        {"loss_tokens": full.num_loss_tokens if full else 0, "tokens": full.num_tokens if full else 0})
    stats_sum, tokens = 0.0, 0
    # Before the step's first pass: a refused check leaves the weights as they were.
    checked = parity.check(step + 1, micros) if parity.due(step + 1) else {}
    for micro, padding in lockstep(micros, how.device):
        loss, stats = sft_loss(policy.lm, micro, how.path)
        weight = 0.0 if padding else stats["loss_tokens"] / max(round(counts["loss_tokens"]), 1)
        (loss * weight).backward()
        if not padding:
            stats_sum += stats["nll"] * stats["loss_tokens"]
            tokens += stats["loss_tokens"]
    total = distributed.all_reduce_sum({"nll": stats_sum, "tokens": tokens})
    stats_sum, tokens = total["nll"], round(total["tokens"])
    grad_norm = clip_and_step(policy, optimizer, scheduler, max_grad_norm)
    return SFTStepResult(stats_sum / max(tokens, 1), tokens, round(counts["tokens"]), grad_norm, checked)


@dataclass(frozen=True)
class SteerProbe:
    """RCTP's steer measurement (rcgrpo.training.steer): the divergent pairs,
    the two reward tokens' ids, and the cadence in steps."""
    pairs: Sequence[Divergence]
    high_id: int
    low_id: int
    every: int


def finetune(run: StageRun, stage: str, policy: TrainablePolicy, trajectories: Sequence[Trajectory], section,
             how: StepSettings, steer_probe: SteerProbe | None = None) -> dict:
    """Train `policy` in place. `section` is cfg.rctp or cfg.sft (lr, batch_size,
    epochs, weight_decay, warmup_ratio, max_grad_norm). Resumable.

    With a `steer_probe` (RCTP), the steer at each pair's first divergent
    token is measured before the first step (a step-0 record), after every
    `steer_probe.every`-th step and after the last, and logged with that
    step's record: it says whether the reward token is being learnt as a
    condition or only the content."""
    if not trajectories:
        raise ValueError(f"[{stage}] no trajectories to train on")
    order = epoch_order(len(trajectories), section.epochs, how.seed)
    total_steps = -(-len(order) // section.batch_size)
    optimizer, scheduler = make_optimizer(policy, section.lr, section.weight_decay, total_steps, section.warmup_ratio)
    parity = ParityOracle(stage, policy, every=how.parity_check_every, path=how.path)

    def take_step(step: int) -> dict:
        t0 = time.perf_counter()
        chunk = [trajectories[i] for i in order[step * section.batch_size:(step + 1) * section.batch_size]]
        done = sft_step(policy, chunk, how, parity, step, optimizer, scheduler, section.max_grad_norm)
        elapsed = time.perf_counter() - t0
        return dict(loss=done.loss, grad_norm=done.grad_norm, lr=scheduler.get_last_lr()[0],
                    tokens_per_s=done.batch_tokens / elapsed, update_s=elapsed, loss_tokens=done.loss_tokens,
                    **done.checked)

    def measure_steer(step: int) -> dict[str, float]:
        policy.eval_mode()
        out = steer(policy.lm, steer_probe.pairs, steer_probe.high_id, steer_probe.low_id, how.micro_batch_tokens)
        policy.train_mode()
        return out

    probing = steer_probe is not None and bool(steer_probe.pairs)
    policy.train_mode()
    last = run_stage(run, StageSteps(stage, total_steps, policy, optimizer, scheduler, take_step, FINETUNE_FIGURES,
                                     rl=False, probe=measure_steer if probing else None,
                                     probe_every=steer_probe.every if probing else 0), how.checkpoint_every)
    policy.eval_mode()
    return last
