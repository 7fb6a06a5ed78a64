"""Supervised fine-tuning on trajectories: the SFT baseline (expert only) and
RCTP (expert + failure, reward-token tagged). Loss only on the tokens the
policy generates (assistant turns), packed micro-batches, AdamW."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

from rcgrpo.base import distributed
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.data.divergence import Divergence
from rcgrpo.model.loading import reward_token_ids
from rcgrpo.model.micro_batching import micro_batches
from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.run.metrics import log_line, progress
from rcgrpo.training.context import RunContext
from rcgrpo.training.lockstep import lockstep
from rcgrpo.training.losses import LossPath, loss_path, sft_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from rcgrpo.training.parity import ParityOracle
from rcgrpo.training.stage_verdict import FINETUNE_FIGURES, StageTally, bar_figures
from rcgrpo.training.steer import steer


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


def sft_step(ctx: RunContext, policy: TrainablePolicy, chunk: Sequence[Trajectory], path: LossPath,
             parity: ParityOracle, step: int, optimizer, scheduler, max_grad_norm: float) -> SFTStepResult:
    """One optimizer step on `chunk`, the step's trajectories. Under torchrun
    each rank trains on its slice of them, weighted by the loss-token count
    over all ranks."""
    lo, hi = distributed.rank_slice(chunk)
    full = pack(chunk[lo:hi]).to(ctx.device) if hi > lo else None
    micros = [] if full is None else micro_batches(full, ctx.cfg.run.micro_batch_tokens, policy.lm.shares_prefixes)
    counts = distributed.all_reduce_sum(
        {"loss_tokens": full.num_loss_tokens if full else 0, "tokens": full.num_tokens if full else 0})
    stats_sum, tokens = 0.0, 0
    # Before the step's first pass: a refused check leaves the weights as they were.
    checked = parity.check(step + 1, micros) if parity.due(step + 1) else {}
    for micro, padding in lockstep(micros, ctx.device):
        loss, stats = sft_loss(policy.lm, micro, path)
        weight = 0.0 if padding else stats["loss_tokens"] / max(round(counts["loss_tokens"]), 1)
        (loss * weight).backward()
        if not padding:
            stats_sum += stats["nll"] * stats["loss_tokens"]
            tokens += stats["loss_tokens"]
    total = distributed.all_reduce_sum({"nll": stats_sum, "tokens": tokens})
    stats_sum, tokens = total["nll"], round(total["tokens"])
    grad_norm = clip_and_step(policy, optimizer, scheduler, max_grad_norm)
    return SFTStepResult(stats_sum / max(tokens, 1), tokens, round(counts["tokens"]), grad_norm, checked)


def finetune(ctx: RunContext, stage: str, policy: TrainablePolicy, trajectories: Sequence[Trajectory],
             section, steer_pairs: Sequence[Divergence] = (), steer_every: int = 0) -> dict:
    """Train `policy` in place. `section` is cfg.rctp or cfg.sft (lr, batch_size,
    epochs, weight_decay, warmup_ratio, max_grad_norm). Resumable.

    With `steer_pairs` and `steer_every` (RCTP), the steer at each pair's
    first divergent token (rcgrpo.training.steer) is measured before the
    first step (a step-0 record), after every `steer_every`-th step and after
    the last, and logged with that step's record: it says whether the reward
    token is being learnt as a condition or only the content."""
    if not trajectories:
        raise ValueError(f"[{stage}] no trajectories to train on")
    order = epoch_order(len(trajectories), section.epochs, ctx.cfg.data.seed)
    total_steps = -(-len(order) // section.batch_size)
    optimizer, scheduler = make_optimizer(policy, section.lr, section.weight_decay, total_steps, section.warmup_ratio)
    start = ctx.resume(stage, policy, optimizer, scheduler)
    probe_every = steer_every if steer_pairs else 0
    tags = reward_token_ids(ctx.tokenizer)

    def measure_steer() -> dict[str, float]:
        policy.eval_mode()
        out = steer(policy.lm, steer_pairs, tags[HIGH_REWARD], tags[LOW_REWARD], ctx.cfg.run.micro_batch_tokens)
        policy.train_mode()
        return out

    policy.train_mode()
    last = {}
    tally = StageTally(stage, rl=False)
    path = loss_path(ctx.cfg.run.fused)
    parity = ParityOracle(stage, policy, every=ctx.cfg.model.parity_check_every, path=path)
    with ctx.metrics(stage, resume_step=start if start else None) as log:
        if probe_every and start == 0:
            log.log(0, **measure_steer())
        bar = progress(range(start, total_steps), total=total_steps, initial=start, desc=stage)
        for step in bar:
            t0 = time.perf_counter()
            chunk = [trajectories[i] for i in order[step * section.batch_size:(step + 1) * section.batch_size]]
            done = sft_step(ctx, policy, chunk, path, parity, step, optimizer, scheduler, section.max_grad_norm)
            elapsed = time.perf_counter() - t0
            probe = (measure_steer() if probe_every and ((step + 1) % probe_every == 0 or step + 1 == total_steps)
                     else {})
            last = log.log(step + 1, loss=done.loss, grad_norm=done.grad_norm,
                           lr=scheduler.get_last_lr()[0], tokens_per_s=done.batch_tokens / elapsed,
                           update_s=elapsed, loss_tokens=done.loss_tokens, **done.checked, **probe)
            tally.add(last)
            bar.set_postfix(bar_figures(last, FINETUNE_FIGURES), refresh=False)
            every = ctx.cfg.run.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < total_steps:
                ctx.save(stage, step + 1, policy, optimizer, scheduler)
        bar.close()
    for line in tally.lines():
        log_line(line)
    policy.eval_mode()
    return last
