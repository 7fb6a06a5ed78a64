"""GRPO and RC-GRPO: B prompts x G multi-turn rollouts per step, group
advantages, the clipped loss with KL to the frozen reference, an optimizer
step, and the new weights pushed into the rollout engine in place.

RC-GRPO differs from GRPO only in the conditioning of the rollouts: each
rollout draws its own reward token with P(high) = p (PAPER.md). GRPO after
RCTP conditions every rollout on <|high_reward|> (what the RCTP policy is
asked for at evaluation); GRPO after SFT uses no token.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections import defaultdict
from typing import Sequence

import torch

import kernels
from rcgrpo import distributed
from rcgrpo.batch import Trajectory, accumulation_weight, loss_normaliser, pack, pack_micro_batches
from rcgrpo.metrics import progress
from rcgrpo.models import HIGH_REWARD
from rcgrpo.policy import TrainablePolicy
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.engine import awake
from rcgrpo.training.context import RunContext
from rcgrpo.training.lockstep import lockstep
from rcgrpo.training.losses import RLLossSettings, reference_logprobs, rl_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer


def prompt_schedule(num_entries: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Entry indices of every step: epochs of seeded shuffles, cut into batches."""
    order: list[int] = []
    epoch = 0
    while len(order) < batch_size * steps:
        idx = list(range(num_entries))
        random.Random(seed * 7_919 + epoch).shuffle(idx)
        order.extend(idx)
        epoch += 1
    return [order[s * batch_size:(s + 1) * batch_size] for s in range(steps)]


def conditioning(stage: str, reward_conditioned_policy: bool, n: int):
    """reward_tokens argument of run_episodes for this stage."""
    if stage == "rc-grpo":
        return "sample"
    return [HIGH_REWARD] * n if reward_conditioned_policy else None


def group_stats(rollouts) -> dict[str, float]:
    """Reward summaries, overall and per reward token, and the share of groups
    whose rewards are all equal (zero advantage: no gradient)."""
    by_group: dict[int, list[float]] = defaultdict(list)
    by_token: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        by_group[r.group].append(r.reward)
        by_token[r.reward_token or "none"].append(r.reward)
    rewards = [r.reward for r in rollouts]
    out = {
        "reward_mean": sum(rewards) / len(rewards),
        "zero_var_frac": sum(len(set(v)) == 1 for v in by_group.values()) / len(by_group),
        "valid_frac": sum(r.valid for r in rollouts) / len(rollouts),
        "r_state_mean": sum(r.r_state for r in rollouts) / len(rollouts),
        "r_action_mean": sum(r.r_action for r in rollouts) / len(rollouts),
    }
    for token, values in by_token.items():
        key = {"<|high_reward|>": "high", "<|low_reward|>": "low"}.get(token, token)
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
                           sum(r.loss_mask)) for r in rollouts]
    return [s for part in distributed.all_gather_objects(mine) for s in part]


def to_trajectories(rollouts) -> list[Trajectory]:
    return [
        Trajectory(r.token_ids, r.loss_mask, group=r.group, reward=r.reward, logprobs=r.logprobs,
                   meta={"entry_id": r.entry_id, "reward_token": r.reward_token})
        for r in rollouts
    ]


def rl_update(ctx: RunContext, policy: TrainablePolicy, trajectories: Sequence[Trajectory],
              settings: RLLossSettings, advantage_scale: str) -> dict[str, float]:
    """Loss + backward over token-balanced micro-batches of one rollout batch.

    Under torchrun, `trajectories` are this rank's whole groups (advantages
    never need another rank's rewards). Each micro-batch is weighted by the
    count over every rank's batch and FSDP sums the ranks' gradients, so the
    update is the one a single process would make on the whole batch. The
    returned statistics are already reduced over ranks.
    """
    fused = ctx.cfg.run.fused
    micros, advantages = [], torch.zeros(0)
    local = {"loss_tokens": 0, "batch_tokens": 0, "normaliser": 0}
    if trajectories:
        full = pack(trajectories).to(ctx.device)
        advantages = kernels.group_advantages(full.rewards, full.seq_group, scale=advantage_scale)
        full = dataclasses.replace(full, advantages=advantages, old_logp=None)
        # Micro-batches without a generated token (e.g. every rollout's prompt
        # was too long) carry no loss: skip their forward passes.
        micros = [m for m in pack_micro_batches(full, ctx.cfg.run.micro_batch_tokens) if m.num_loss_tokens]
        local = {"loss_tokens": full.num_loss_tokens, "batch_tokens": full.num_tokens,
                 "normaliser": loss_normaliser(full, settings.loss_type)}
    counts = distributed.all_reduce_sum(local)
    sums: dict[str, float] = defaultdict(float)
    for micro, padding in lockstep(micros, ctx.device):
        if settings.beta > 0:
            micro = dataclasses.replace(
                micro, ref_logp=reference_logprobs(policy, micro, fused, settings.temperature))
        weight = 0.0 if padding else accumulation_weight(micro, None, settings.loss_type,
                                                         total=round(counts["normaliser"]))
        loss, stats = rl_loss(policy.lm, micro, settings, fused)
        (loss * weight).backward()
        if padding:
            continue
        sums["loss"] += float(loss.detach()) * weight
        for key, value in stats.items():
            sums[key] += float(value) * weight
    out = distributed.all_reduce_sum(dict(sums))
    out["loss_tokens"], out["batch_tokens"] = round(counts["loss_tokens"]), round(counts["batch_tokens"])
    # Every rank's advantages, in rank order (as one process would hold them).
    adv = torch.tensor(sum(distributed.all_gather_objects(advantages.tolist()), []), dtype=torch.float32)
    out["adv_std"] = float(adv.std(unbiased=False)) if adv.numel() > 1 else 0.0
    out["adv_abs_mean"] = float(adv.abs().mean())
    return out


def step_share(schedule_row: Sequence[int], tp_size: int) -> tuple[list[int], int, tuple[int, int]]:
    """This rank's part of one step's prompts (entry indices).

    Returns (the prompts its engine plays, the position of the first of them
    in the step, the [start, end) of those the rank trains on). An engine
    group of `tp_size` ranks plays one slice of the prompts together (a
    tensor-parallel engine answers its ranks' identical calls once); each
    rank then trains on its own whole groups of that slice.
    """
    world, r = distributed.world_size(), distributed.rank()
    start, end = distributed.rank_slice(schedule_row, world // tp_size, r // tp_size)
    played = list(schedule_row[start:end])
    mine = distributed.rank_slice(played, tp_size, r % tp_size)
    return played, start, mine


def train_rl(ctx: RunContext, stage: str, policy: TrainablePolicy, engine, entries: Sequence,
             reward_conditioned: bool) -> dict:
    """Run the GRPO / RC-GRPO stage in place on `policy`; resumable.

    Per step: the engine wakes, takes the policy's current weights (on the
    first step too: it may hold another stage's weights, or a resumed run's
    older ones), plays the step's rollouts and goes back to sleep; then the
    update runs with the accelerator's memory to itself."""
    g = ctx.cfg.grpo
    batch_size = g.batch_size
    schedule = prompt_schedule(len(entries), batch_size, g.steps, ctx.cfg.data.seed)
    optimizer, scheduler = make_optimizer(policy, g.lr, g.weight_decay, g.steps, 0.0)
    start = ctx.resume(stage, policy, optimizer, scheduler)
    settings = RLLossSettings(g.eps_low, g.eps_high, g.beta, g.temperature, g.loss_type,
                              max_tokens=float(g.max_total_tokens) if g.loss_type == "dr_grpo" else None)
    last = {}
    with ctx.metrics(stage, resume_step=start if start else None) as log:
        for step in progress(range(start, g.steps), total=g.steps, initial=start, desc=stage):
            played, offset, (lo, hi) = step_share(schedule[step], ctx.cfg.run.engine_tp_size)
            step_entries = [entries[i] for i in played]
            rollout_cfg = RolloutConfig(
                max_new_tokens=g.max_new_tokens, max_total_tokens=g.max_total_tokens,
                temperature=g.temperature, top_p=g.top_p,
                # Each engine group's share of the step gets its own seeds.
                seed=ctx.cfg.data.seed * 100_003 + step + 1_000_003 * offset,
                p_high=g.p_high, doc_style=ctx.cfg.data.doc_style, progress=False,
            )
            t0 = time.perf_counter()
            policy.eval_mode()
            with awake(engine, policy.rollout_weights()):
                rollouts = run_episodes(engine, ctx.tokenizer, step_entries, g.group_size, rollout_cfg,
                                        reward_tokens=conditioning(stage, reward_conditioned,
                                                                   len(step_entries) * g.group_size))
            rollouts = [r for r in rollouts if lo <= r.group < hi]
            t1 = time.perf_counter()
            policy.train_mode()
            stats = rl_update(ctx, policy, to_trajectories(rollouts), settings, g.advantage_scale)
            grad_norm = clip_and_step(policy, optimizer, scheduler, g.max_grad_norm)
            policy.eval_mode()
            t2 = time.perf_counter()
            everyone = gather_summaries(rollouts, offset)
            generated = sum(s.generated for s in everyone)
            last = log.log(
                step + 1,
                **group_stats(everyone), **stats, grad_norm=grad_norm,
                lr=scheduler.get_last_lr()[0], rollout_s=t1 - t0, update_s=t2 - t1,
                tokens_per_s=stats["batch_tokens"] / max(t2 - t1, 1e-9),
                generated_tokens_per_s=generated / max(t1 - t0, 1e-9),
            )
            if ctx.cfg.run.checkpoint_every and (step + 1) % ctx.cfg.run.checkpoint_every == 0 and step + 1 < g.steps:
                ctx.save(stage, step + 1, policy, optimizer, scheduler)
    return last
