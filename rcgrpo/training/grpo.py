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

import kernels
from rcgrpo.batch import PackedBatch, Trajectory, accumulation_weight, pack, pack_micro_batches
from rcgrpo.metrics import progress
from rcgrpo.models import HIGH_REWARD
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.training.context import RunContext, clip_and_step, make_optimizer
from rcgrpo.training.losses import RLLossSettings, reference_logprobs, rl_loss
from rcgrpo.training.weight_sync import rollout_weights


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


def to_trajectories(rollouts) -> list[Trajectory]:
    return [
        Trajectory(r.token_ids, r.loss_mask, group=r.group, reward=r.reward, logprobs=r.logprobs,
                   meta={"entry_id": r.entry_id, "reward_token": r.reward_token})
        for r in rollouts
    ]


def rl_update(ctx: RunContext, model, ref_model, trajectories: Sequence[Trajectory], settings: RLLossSettings,
              advantage_scale: str) -> tuple[dict[str, float], PackedBatch]:
    """Loss + backward over token-balanced micro-batches of one rollout batch."""
    fused = ctx.cfg.run.fused
    full = pack(trajectories).to(ctx.device)
    advantages = kernels.group_advantages(full.rewards, full.seq_group, scale=advantage_scale)
    full = dataclasses.replace(full, advantages=advantages, old_logp=None)
    sums: dict[str, float] = defaultdict(float)
    # Micro-batches without a generated token (e.g. every rollout's prompt
    # was too long) carry no loss: skip their forward passes.
    micros = [m for m in pack_micro_batches(full, ctx.cfg.run.micro_batch_tokens) if m.num_loss_tokens]
    for micro in micros:
        if settings.beta > 0:
            micro = dataclasses.replace(
                micro, ref_logp=reference_logprobs(ref_model, micro, fused, settings.temperature))
        weight = accumulation_weight(micro, full, settings.loss_type)
        loss, stats = rl_loss(model, micro, settings, fused)
        (loss * weight).backward()
        sums["loss"] += float(loss.detach()) * weight
        for key, value in stats.items():
            sums[key] += float(value) * weight
    sums["adv_std"] = float(advantages.std(unbiased=False)) if advantages.numel() > 1 else 0.0
    sums["adv_abs_mean"] = float(advantages.abs().mean())
    sums["loss_tokens"] = full.num_loss_tokens
    sums["batch_tokens"] = full.num_tokens
    return dict(sums), full


def train_rl(ctx: RunContext, stage: str, model, ref_model, engine, entries: Sequence, reward_conditioned: bool) -> dict:
    """Run the GRPO / RC-GRPO stage in place on `model`; resumable."""
    g = ctx.cfg.grpo
    batch_size = g.batch_size
    schedule = prompt_schedule(len(entries), batch_size, g.steps, ctx.cfg.data.seed)
    optimizer, scheduler = make_optimizer(model, g.lr, g.weight_decay, g.steps, 0.0)
    start = ctx.resume(stage, model, optimizer, scheduler)
    if start:
        engine.load_weights(rollout_weights(model))
    settings = RLLossSettings(g.eps_low, g.eps_high, g.beta, g.temperature, g.loss_type,
                              max_tokens=float(g.max_total_tokens) if g.loss_type == "dr_grpo" else None)
    last = {}
    with ctx.metrics(stage, resume_step=start if start else None) as log:
        for step in progress(range(start, g.steps), total=g.steps, initial=start, desc=stage):
            step_entries = [entries[i] for i in schedule[step]]
            rollout_cfg = RolloutConfig(
                max_new_tokens=g.max_new_tokens, max_total_tokens=g.max_total_tokens,
                temperature=g.temperature, top_p=g.top_p, seed=ctx.cfg.data.seed * 100_003 + step,
                p_high=g.p_high, doc_style=ctx.cfg.data.doc_style, progress=False,
            )
            t0 = time.perf_counter()
            model.eval()
            rollouts = run_episodes(engine, ctx.tokenizer, step_entries, g.group_size, rollout_cfg,
                                    reward_tokens=conditioning(stage, reward_conditioned, len(step_entries) * g.group_size))
            t1 = time.perf_counter()
            model.train()
            stats, full = rl_update(ctx, model, ref_model, to_trajectories(rollouts), settings, g.advantage_scale)
            grad_norm = clip_and_step(model, optimizer, scheduler, g.max_grad_norm)
            model.eval()
            engine.load_weights(rollout_weights(model))
            t2 = time.perf_counter()
            generated = sum(sum(r.loss_mask) for r in rollouts)
            last = log.log(
                step + 1,
                **group_stats(rollouts), **stats, grad_norm=grad_norm,
                lr=scheduler.get_last_lr()[0], rollout_s=t1 - t0, update_s=t2 - t1,
                tokens_per_s=full.num_tokens / max(t2 - t1, 1e-9), generated_tokens_per_s=generated / max(t1 - t0, 1e-9),
            )
            if ctx.cfg.run.checkpoint_every and (step + 1) % ctx.cfg.run.checkpoint_every == 0 and step + 1 < g.steps:
                ctx.save(stage, step + 1, model, optimizer, scheduler)
    return last
