"""GRPO and RC-GRPO: B prompts x G multi-turn rollouts per step, group
advantages, the clipped loss with KL to the frozen reference, an optimizer
step, and the new weights pushed into the rollout engine in place.

RC-GRPO differs from GRPO only in the conditioning of the rollouts: each
rollout draws its own reward token with P(high) = p (the paper, arXiv
2602.03025). GRPO after RCTP conditions every rollout on <|high_reward|>
(what the RCTP policy is asked for at evaluation); GRPO after SFT uses no
token (the rule: rcgrpo.conditioning.reward_tokens.rl_rollout_conditioning).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import defaultdict
from typing import Sequence

import torch

import rcgrpo_kernels
from rcgrpo.base import distributed
from rcgrpo.conditioning.reward_tokens import rl_rollout_conditioning, short_name, stage_saw_reward_tokens
from rcgrpo.evaluation.sampled_reward import reward_metrics, sampled_reward
from rcgrpo.model.packing import (
    PackedBatch,
    Trajectory,
    accumulation_weight,
    informative_sequences,
    loss_normaliser,
    pack,
)
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.model.prefix_sharing import forwarded_tokens, micro_batch_plan, micro_batches
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.engine import play_awake
from rcgrpo.run.metrics import log_line, progress
from rcgrpo.training.context import RunContext
from rcgrpo.training.lockstep import lockstep
from rcgrpo.training.losses import RLLossSettings, current_logprobs, reference_logprobs, rl_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from rcgrpo.training.parity import ParityOracle
from rcgrpo.training.stage_verdict import RL_FIGURES, StageTally, bar_figures


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
        "zero_var_frac": sum(len(set(v)) == 1 for v in by_group.values()) / len(by_group),
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


def to_trajectories(rollouts) -> list[Trajectory]:
    """Trajectories of the update. The engine's log-probs travel only when
    every rollout has them (a scripted one has none): a batch has them for
    all its tokens or not at all."""
    with_logprobs = all(r.logprobs is not None for r in rollouts)
    return [
        Trajectory(r.token_ids, r.sampled_mask, group=r.group, reward=r.reward,
                   logprobs=r.logprobs if with_logprobs else None, versions=r.versions or None,
                   meta={"entry_id": r.entry_id, "reward_token": r.reward_token})
        for r in rollouts
    ]


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """How one step's rollout batch becomes optimizer steps (GrpoConfig's
    update settings, without the rest of the config)."""
    advantage_estimator: str = "grpo"
    updates_per_batch: int = 1  # PPO epochs, mu
    mini_batches: int = 1  # optimizer steps per pass
    tis_cap: float | None = None  # truncated importance sampling; None = off
    informative_only: bool = False  # grpo.loss_over_informative_groups
    max_grad_norm: float = 1.0
    seed: int = 0  # mini-batch shuffles

    @classmethod
    def from_config(cls, g, seed: int) -> "UpdateSettings":
        return cls(g.advantage_estimator, g.updates_per_batch, g.mini_batches, g.tis_cap,
                   bool(g.loss_over_informative_groups or g.dynamic_sampling), g.max_grad_norm, seed)

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout batch: the pre-update policy is the
        current one, so its log-probs come from the loss pass itself."""
        return self.updates_per_batch == 1 and self.mini_batches == 1


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


def prepare_batch(trajectories: Sequence[Trajectory], device: torch.device, advantage_estimator: str,
                  informative_only: bool) -> tuple[PackedBatch | None, torch.Tensor]:
    """This rank's packed batch with group advantages attached (None when it
    is left empty), and every advantage (for the step's statistics).
    `informative_only` keeps only groups with non-zero advantage."""
    if not trajectories:
        return None, torch.zeros(0)
    full = pack(trajectories).to(device)
    advantages = rcgrpo_kernels.group_advantages(full.rewards, full.seq_group, estimator=advantage_estimator)
    full = dataclasses.replace(full, advantages=advantages, old_logp=None)
    if informative_only:
        keep = torch.nonzero(informative_sequences(full)).reshape(-1).tolist()
        full = full.select(keep) if keep else None
    return full, advantages


# Token counts of a pass over the batch, summed over ranks: the tokens trained
# on, packed, and computed by the decoder (shared prompt prefixes once).
TOKEN_COUNTS = ("loss_tokens", "batch_tokens", "forward_tokens")


def _micro_batch_indices(ctx: RunContext, policy: TrainablePolicy, batch: PackedBatch | None) -> list[list[int]]:
    # Balanced on the tokens each forward computes: with prefix sharing a
    # group's prompt counts once per micro-batch.
    if batch is None:
        return []
    return micro_batch_plan(batch, ctx.cfg.run.micro_batch_tokens, policy.lm.shares_prefixes)


def _micro_batches(ctx: RunContext, policy: TrainablePolicy, batch: PackedBatch | None) -> list[PackedBatch]:
    # Micro-batches without a generated token (e.g. every rollout's prompt was
    # too long) carry no loss: their forward passes are skipped.
    if batch is None:
        return []
    micros = micro_batches(batch, ctx.cfg.run.micro_batch_tokens, policy.lm.shares_prefixes)
    return [m for m in micros if m.num_loss_tokens]


@torch.no_grad()
def trainer_logprobs(ctx: RunContext, policy: TrainablePolicy, batch: PackedBatch | None,
                     temperature: float) -> torch.Tensor | None:
    """[N] the current policy's log-probs at the batch's loss positions (0
    elsewhere): the old log-probs of PPO epochs, taken once before the first
    update, micro-batch by micro-batch, in lockstep with the other ranks."""
    fused = ctx.cfg.run.fused
    out = None if batch is None else torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    micros = [(m, batch.token_positions(ix)) for ix in _micro_batch_indices(ctx, policy, batch)
              if (m := batch.select(ix)).num_loss_tokens]
    for item, padding in lockstep(micros, ctx.device):
        micro, positions = (item, None) if padding else item
        hidden = policy.lm.hidden_states(micro)  # a padding pass too: FSDP's collectives pair up
        if not padding:
            out[positions] = current_logprobs(policy.lm, micro, fused, temperature, hidden)
    return out


def accumulate_gradients(ctx: RunContext, policy: TrainablePolicy, batch: PackedBatch | None,
                         settings: RLLossSettings, tis_cap: float | None = None,
                         agreement: Agreement | None = None) -> dict[str, float]:
    """Loss + backward over the token-balanced micro-batches of one (mini-)batch:
    the gradient of one optimizer step.

    Under torchrun, `batch` holds this rank's whole groups (advantages never
    need another rank's rewards). Each micro-batch is weighted by the count
    over every rank's batch and FSDP sums the ranks' gradients, so the update
    is the one a single process would make on the whole batch. The returned
    statistics are already reduced over ranks.

    The trainer's pre-update log-probs are `batch.old_logp` when given (PPO
    epochs), else those of this very pass (on-policy), taken from its hidden
    states by one LM-head pass over the loss rows: they feed the truncated
    importance weights and the engine/trainer agreement.
    """
    fused = ctx.cfg.run.fused
    micros = _micro_batches(ctx, policy, batch)
    local = {"loss_tokens": 0, "batch_tokens": 0, "forward_tokens": 0, "normaliser": 0}
    if batch is not None:
        local = {"loss_tokens": batch.num_loss_tokens, "batch_tokens": batch.num_tokens,
                 "forward_tokens": sum(forwarded_tokens(m, policy.lm.shares_prefixes) for m in micros),
                 "normaliser": loss_normaliser(batch, settings.loss_type)}
    counts = distributed.all_reduce_sum(local)
    if tis_cap is not None and any(m.engine_logp is None for m in micros):
        raise ValueError("grpo.tis_cap needs the engine's log-probs of every sampled token; "
                         "this batch's rollouts came without them")
    # The keys every rank's losses report, set before the passes: a rank with
    # padding passes only must reduce the same keys as the others.
    sums = dict.fromkeys(("loss", "clip_frac", "entropy") + (("kl",) if settings.beta > 0 else ()), 0.0)
    # Until the first optimizer step the policy is its reference, computing
    # exactly like it (tests/training/test_precision.py): the reference's
    # log-probs are then the policy's own, read off this pass's hidden states
    # by one LM-head pass over the loss rows instead of a second decoder pass.
    own_reference = settings.beta > 0 and policy.equals_reference
    summing = None if rcgrpo_kernels.get_loss_type(settings.loss_type).divides else max(counts["loss_tokens"], 1)
    for micro, padding in lockstep(micros, ctx.device):
        if settings.beta > 0 and not own_reference:
            micro = dataclasses.replace(
                micro, ref_logp=reference_logprobs(policy, micro, fused, settings.temperature))
        hidden = policy.lm.hidden_states(micro)
        # This pass's own log-probs, taken once: the reference's (above) and,
        # on-policy, the pre-update ones of TIS and the agreement.
        own_logp = current_logprobs(policy.lm, micro, fused, settings.temperature, hidden) if own_reference else None
        if own_reference:
            micro = dataclasses.replace(micro, ref_logp=own_logp)
        weights = None
        if not padding and micro.engine_logp is not None and (tis_cap is not None or agreement is not None):
            old = micro.old_logp
            if old is None:
                old = own_logp if own_logp is not None else current_logprobs(
                    policy.lm, micro, fused, settings.temperature, hidden)
            if tis_cap is not None:
                weights = tis_weights(old, micro.engine_logp, tis_cap, micro.loss_mask)
            if agreement is not None:
                agreement.add(micro, old, tis_cap)
        weight = 0.0 if padding else accumulation_weight(micro, None, settings.loss_type,
                                                         total=round(counts["normaliser"]))
        loss, stats = rl_loss(policy.lm, micro, settings, fused, hidden=hidden, token_weights=weights)
        (loss * weight).backward()
        if padding:
            continue
        sums["loss"] += float(loss.detach()) * weight
        # Statistics are per-token means: a sum loss's parts (weight 1 each)
        # average them by their share of the loss tokens instead.
        stat_weight = weight if summing is None else micro.num_loss_tokens / summing
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + float(value) * stat_weight
    out = distributed.all_reduce_sum(dict(sums))
    for key in TOKEN_COUNTS:
        out[key] = round(counts[key])
    return out


def _advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    # Every rank's advantages, in rank order (as one process would hold them).
    adv = torch.tensor(sum(distributed.all_gather_objects(advantages.tolist()), []), dtype=torch.float32)
    return {"adv_std": float(adv.std(unbiased=False)) if adv.numel() > 1 else 0.0,
            "adv_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0}


def rl_update(ctx: RunContext, policy: TrainablePolicy, trajectories: Sequence[Trajectory],
              settings: RLLossSettings, advantage_estimator: str, *, tis_cap: float | None = None,
              informative_only: bool = False) -> dict[str, float]:
    """The on-policy update's gradient (one pass, no optimizer step) with the
    engine/trainer agreement of its tokens. Leaves the policy in train mode,
    dropout off (as `rl_step`)."""
    policy.train_mode(dropout=False)
    batch, advantages = prepare_batch(trajectories, ctx.device, advantage_estimator, informative_only)
    agreement = Agreement()
    out = accumulate_gradients(ctx, policy, batch, settings, tis_cap, agreement)
    return {**out, **agreement.summary(tis_cap is not None), **_advantage_stats(advantages)}


def mini_batch_split(batch: PackedBatch | None, parts: int, seed: int) -> list[PackedBatch | None]:
    """`parts` mini-batches of whole groups, in a seeded random order (None for
    a part left without a group)."""
    if batch is None:
        return [None] * parts
    if parts == 1:
        return [batch]  # the whole batch as packed: the on-policy update sees it unchanged
    groups = sorted(set(batch.seq_group.tolist()))
    random.Random(seed).shuffle(groups)
    seq_group = batch.seq_group.tolist()
    out = []
    for k in range(parts):
        mine = set(groups[k::parts])
        idx = [i for i, g in enumerate(seq_group) if g in mine]
        out.append(batch.select(idx) if idx else None)
    return out


def rl_step(ctx: RunContext, policy: TrainablePolicy, optimizer, scheduler, trajectories: Sequence[Trajectory],
            settings: RLLossSettings, update: UpdateSettings, step: int = 0,
            parity: ParityOracle | None = None) -> dict[str, float]:
    """All optimizer steps of one rollout batch: `updates_per_batch` passes,
    each of `mini_batches` steps. Off-policy (more than one step) the old
    log-probs are the trainer's, computed once before the first update, so
    the ratio and its clip act from the second step on.

    Every pass, the old log-probs' included, runs in train mode with dropout
    off: the policy scored is the one the engine sampled from, and the ratio
    is exactly 1 before the first step (LoRA's dropout would move it).

    A step whose gradient is exactly zero is skipped: no forward or backward
    pass and no optimizer step (`update_skipped` 1 in its metrics). That is a
    batch with no loss token on any rank (e.g. every group uninformative under
    `informative_only`), or one whose every group has zero advantage while
    the KL term has no gradient either: beta 0, or a policy still equal to its
    reference (`policy.equals_reference`: loaded with it, no optimizer step yet).
    After the first update a zero-advantage batch with beta > 0 still trains
    on its KL term (the paper's loss).

    `parity` (the stage's tree parity oracle, rcgrpo.training.parity) checks
    the first step that forwards (and every `model.parity_check_every`-th) on
    its first micro-batch, before any pass of the step."""
    policy.train_mode(dropout=False)
    batch, advantages = prepare_batch(trajectories, ctx.device, update.advantage_estimator,
                                      update.informative_only)
    out: dict[str, float] = {**_advantage_stats(advantages), "updates": 0, "update_skipped": 1}
    local_tokens = 0 if batch is None else batch.num_loss_tokens
    if distributed.all_reduce_max(local_tokens) == 0:
        return out
    any_advantage = distributed.all_reduce_max(int(bool(advantages.ne(0).any())))
    kl_has_gradient = settings.beta > 0 and not policy.equals_reference
    if not any_advantage and not kl_has_gradient:
        return out
    out["update_skipped"] = 0
    if parity is not None and parity.due(step + 1):
        # Before the old log-probs and the first update: every pass of the step uses the checked forward.
        out.update(parity.check(step + 1, _micro_batches(ctx, policy, batch)))
    agreement = Agreement()
    tis = update.tis_cap is not None
    if not update.on_policy:
        old = trainer_logprobs(ctx, policy, batch, settings.temperature)
        if batch is not None:
            batch = dataclasses.replace(batch, old_logp=old)
            agreement.add(batch, old, update.tis_cap)
    totals: dict[str, float] = defaultdict(float)
    norms = []
    for epoch in range(update.updates_per_batch):
        parts = mini_batch_split(batch, update.mini_batches, update.seed * 1_000_003 + step * 101 + epoch)
        for part in parts:
            stats = accumulate_gradients(ctx, policy, part, settings, update.tis_cap,
                                         agreement if update.on_policy else None)
            if not stats["loss_tokens"]:
                continue  # a mini-batch left without groups on every rank: no step to take
            norms.append(clip_and_step(policy, optimizer, scheduler, update.max_grad_norm))
            for key in ("loss", "clip_frac", "kl", "entropy"):
                if key in stats:
                    totals[key] += stats[key]
            if update.updates_per_batch > 1:
                totals[f"clip_frac_pass{epoch + 1}"] += stats.get("clip_frac", 0.0) / update.mini_batches
            if epoch == 0:
                for key in TOKEN_COUNTS:
                    totals[key] += stats[key]
    n = len(norms)
    out.update({k: (v if k.startswith("clip_frac_pass") or k.endswith("_tokens") else v / n)
                for k, v in totals.items()})
    for key in TOKEN_COUNTS:
        out[key] = round(out[key])
    out.update(agreement.summary(tis), updates=n, grad_norm=sum(norms) / n)
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


def informative_groups(rollouts) -> list[list]:
    """The groups (rollouts of one prompt, in order) whose rewards are not all
    equal: the only ones with a non-zero advantage."""
    by_group: dict[int, list] = defaultdict(list)
    for r in rollouts:
        by_group[r.group].append(r)
    return [rs for _, rs in sorted(by_group.items()) if len({r.reward for r in rs}) > 1]


def extra_prompts(num_entries: int, used: set[int], count: int, rng: random.Random) -> list[int]:
    """`count` entry indices for a dynamic-sampling draw: entries not yet
    played in this step first, in a seeded order; repeats only once every
    entry has been played."""
    fresh = [i for i in range(num_entries) if i not in used]
    rng.shuffle(fresh)
    picked = fresh[:count]
    while len(picked) < count:
        picked.append(rng.randrange(num_entries))
    return picked


def dynamic_sampling(play, first_prompts: Sequence[int], first_rollouts, num_entries: int, batch_size: int,
                     max_draws: int, seed: int) -> tuple[list, dict[str, int]]:
    """DAPO's dynamic sampling: keep the informative groups of the step's
    scheduled prompts, and while fewer than `batch_size` are kept and fewer
    than `max_draws` rounds were played, draw as many new prompts as are
    missing and play them (`play(entry_indices, draw) -> rollouts`).

    Returns the kept rollouts (at most `batch_size` groups, renumbered 0..K-1
    in the order they were kept) and the step's counts."""
    rng = random.Random(seed)
    kept = informative_groups(first_rollouts)
    drawn, draws = len(first_prompts), 1
    used = set(first_prompts)
    while len(kept) < batch_size and draws < max_draws:
        prompts = extra_prompts(num_entries, used, batch_size - len(kept), rng)
        used.update(prompts)
        kept.extend(informative_groups(play(prompts, draws)))
        drawn += len(prompts)
        draws += 1
    kept = kept[:batch_size]
    rollouts = [dataclasses.replace(r, group=g) for g, group in enumerate(kept) for r in group]
    counts = {"ds_draws": draws, "ds_prompts_drawn": drawn, "ds_groups_kept": len(kept),
              "ds_groups_dropped": drawn - len(kept)}
    return rollouts, counts


def probe_seed(data_seed: int) -> int:
    """The sampled-reward probe's rollout seed: apart from every step's
    rollout seeds (data_seed * 100_003 + step). A probe replayed elsewhere
    with it (benchmarks/learning.py) plays the very rollouts the trainer's did."""
    return data_seed * 100_003 + 50_021


class RewardProbe:
    """The RL stage's learning curve: sampled reward on a fixed sample of its
    training prompts (rcgrpo.evaluation.sampled_reward), measured with the
    policy's current weights before the first step, every `grpo.eval_every`
    steps and after the last. Under each reward token for a policy trained
    with them (the gap high - low is the token's effect), else without one.
    The entries are a seeded choice of at most `grpo.eval_rollouts`
    training entries; the seeds are the same at every measurement."""

    def __init__(self, ctx: RunContext, stage: str, policy: TrainablePolicy, engine, entries: Sequence,
                 finetune_stage: str):
        g = ctx.cfg.grpo
        self.ctx, self.stage, self.policy, self.engine = ctx, stage, policy, engine
        n = min(len(entries), g.eval_rollouts)
        self.entries = [entries[i] for i in sorted(random.Random(ctx.cfg.data.seed).sample(range(len(entries)), n))]
        self.conditionings = ("high", "low") if stage_saw_reward_tokens(stage, finetune_stage) else ("none",)
        self.config = RolloutConfig(max_new_tokens=g.max_new_tokens, max_total_tokens=g.max_total_tokens,
                                    temperature=g.temperature, top_p=g.top_p,
                                    seed=probe_seed(ctx.cfg.data.seed),
                                    doc_style=ctx.cfg.data.doc_style, progress=False)

    def measure(self, step: int) -> dict[str, float]:
        """Every rank plays the same sample (its engine takes the weights: a
        collective under FSDP); rank 0 logs the result."""
        def play(live):
            return {c: sampled_reward(live, self.ctx.tokenizer, self.entries, c, self.ctx.cfg.grpo.eval_rollouts,
                                      self.config) for c in self.conditionings}

        rates, replays = play_awake(self.engine, self.policy.rollout_weights, play,
                                    f"[{self.stage}] the sampled-reward probe at step {step}", warn=log_line,
                                    replay=not distributed.active())
        if distributed.is_main():
            log_line(f"[{self.stage}] step {step}: sampled reward on {len(self.entries)} training prompts: "
                     + "; ".join(f"{c} {r}" for c, r in rates.items()))
        return {**reward_metrics(rates), "probe_engine_replays": replays}


def train_rl(ctx: RunContext, stage: str, policy: TrainablePolicy, engine, entries: Sequence,
             finetune_stage: str) -> dict:
    """Run the GRPO / RC-GRPO stage in place on `policy`; resumable.
    `finetune_stage` ("rctp" or "sft") is the stage `policy` comes from: with
    `stage` it decides the rollouts' reward tokens (rl_rollout_conditioning).

    Per step: the engine wakes, takes the policy's current weights (on the
    first step too: it may hold another stage's weights, or a resumed run's
    older ones), plays the step's rollouts and goes back to sleep; then the
    update runs with the accelerator's memory to itself. With dynamic
    sampling, zero-variance groups are dropped and more prompts played
    before the update (`dynamic_sampling`).

    The policy version is the number of optimizer steps the stage has taken
    (the scheduler's count, so a resumed run continues it); the engine's
    weights carry the version they were pushed at, and every sampled token
    records it.

    With `grpo.eval_every`, the stage's learning curve (`RewardProbe`) is
    measured before the first step (a step-0 record), after every
    `eval_every`-th step and after the last, and logged with that step."""
    g = ctx.cfg.grpo
    batch_size = g.batch_size
    schedule = prompt_schedule(len(entries), batch_size, g.steps, ctx.cfg.data.seed)
    update = UpdateSettings.from_config(g, ctx.cfg.data.seed)
    optimizer, scheduler = make_optimizer(policy, g.lr, g.weight_decay,
                                          g.steps * g.updates_per_batch * g.mini_batches, 0.0)
    start = ctx.resume(stage, policy, optimizer, scheduler)
    settings = RLLossSettings.from_config(g)
    conditioning = rl_rollout_conditioning(stage, finetune_stage, g.p_high)
    probe = RewardProbe(ctx, stage, policy, engine, entries, finetune_stage)
    parity = ParityOracle(stage, policy, every=ctx.cfg.model.parity_check_every, fused=ctx.cfg.run.fused,
                          temperature=settings.temperature)
    last = {}
    tally = StageTally(stage, rl=True)
    with ctx.metrics(stage, resume_step=start if start else None) as log:
        if g.eval_every and start == 0:
            log.log(0, **probe.measure(0))
        bar = progress(range(start, g.steps), total=g.steps, initial=start, desc=stage)
        for step in bar:
            played, offset, (lo, hi) = step_share(schedule[step], ctx.cfg.run.engine_tp_size)
            version = scheduler.last_epoch
            rollout_cfg = RolloutConfig(
                max_new_tokens=g.max_new_tokens, max_total_tokens=g.max_total_tokens,
                # The loss settings' temperature, so that the engine samples (and reports
                # log-probs) at exactly the temperature the trainer scores the tokens at.
                temperature=settings.temperature, top_p=g.top_p,
                # Each engine group's share of the step gets its own seeds.
                seed=ctx.cfg.data.seed * 100_003 + step + 1_000_003 * offset,
                doc_style=ctx.cfg.data.doc_style, progress=False, policy_version=version,
            )

            extra_generated = []  # tokens sampled by each rollout of dynamic sampling's extra draws

            def play(indices, draw, live):
                step_entries = [entries[i] for i in indices]
                cfg = dataclasses.replace(rollout_cfg, seed=rollout_cfg.seed + 7_777_777 * draw)
                out = run_episodes(live, ctx.tokenizer, step_entries, g.group_size, cfg, reward_tokens=conditioning)
                if draw:
                    extra_generated.extend(sum(r.sampled_mask) for r in out)
                return out

            def phase(live):
                extra_generated.clear()  # a replay starts the phase over
                scheduled = play(played, 0, live)
                if not g.dynamic_sampling:
                    return scheduled, scheduled, {}
                kept, counts = dynamic_sampling(
                    lambda idx, draw: play(idx, draw, live), played, scheduled, len(entries), batch_size,
                    g.dynamic_sampling_max_draws, seed=ctx.cfg.data.seed * 1_000_003 + step)
                return kept, scheduled, counts

            t0 = time.perf_counter()
            policy.eval_mode()
            (rollouts, scheduled, ds_counts), replays = play_awake(
                engine, policy.rollout_weights, phase, f"[{stage}] step {step + 1}'s rollouts", warn=log_line,
                replay=not distributed.active())
            # Dynamic sampling is single-process: its renumbered groups all lie in [lo, hi).
            rollouts = [r for r in rollouts if lo <= r.group < hi]
            t1 = time.perf_counter()
            stats = rl_step(ctx, policy, optimizer, scheduler, to_trajectories(rollouts), settings, update, step,
                            parity)
            policy.eval_mode()
            t2 = time.perf_counter()
            evaluated = {}
            if g.eval_every and ((step + 1) % g.eval_every == 0 or step + 1 == g.steps):
                evaluated = probe.measure(step + 1)
            # Reward statistics are those of the scheduled prompts (comparable
            # across pipelines); dynamic sampling's extra draws are counted apart.
            everyone = gather_summaries([r for r in scheduled if lo <= r.group < hi], offset)
            generated = sum(s.generated for s in everyone) + sum(extra_generated)
            last = log.log(
                step + 1,
                **group_stats(everyone), **stats, **ds_counts, policy_version=version, engine_replays=replays,
                rollouts_played=len(everyone) + len(extra_generated),
                lr=scheduler.get_last_lr()[0], rollout_s=t1 - t0, update_s=t2 - t1,
                tokens_per_s=stats.get("batch_tokens", 0) / max(t2 - t1, 1e-9),
                generated_tokens_per_s=generated / max(t1 - t0, 1e-9), **evaluated,
            )
            tally.add(last)
            bar.set_postfix(bar_figures(last, RL_FIGURES), refresh=False)
            if ctx.cfg.run.checkpoint_every and (step + 1) % ctx.cfg.run.checkpoint_every == 0 and step + 1 < g.steps:
                ctx.save(stage, step + 1, policy, optimizer, scheduler)
        bar.close()
    for line in tally.lines():
        log_line(line)
    return last
