"""One RL update from one step's trajectories: the packed batch with its group
advantages, mini-batches of whole groups, gradient accumulation over
token-balanced micro-batches, and the optimizer steps.

`rl_update` is the update: the RL stage's loop (rcgrpo.training.rl_loop)
calls it every step with the optimizer; without one (an on-policy update)
it leaves the gradient of its one pass for the caller.
"""
from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from typing import Sequence

import torch

import rcgrpo_kernels
from rcgrpo.base import distributed
from rcgrpo.model.micro_batching import micro_batch, micro_batch_plan, micro_batches
from rcgrpo.model.packing import (
    PackedBatch,
    Trajectory,
    accumulation_weight,
    informative_sequences,
    loss_normaliser,
    pack,
)
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.model.prefix_sharing import forwarded_tokens
from rcgrpo.training.agreement import Agreement, tis_weights
from rcgrpo.training.lockstep import lockstep
from rcgrpo.training.losses import LossPath, RLLossSettings, current_logprobs, reference_logprobs, rl_loss
from rcgrpo.training.optimizer import clip_and_step
from rcgrpo.training.parity import ParityOracle
from rcgrpo.training.rl_statistics import advantage_stats
from rcgrpo.training.step_settings import StepSettings


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


@torch.no_grad()
def trainer_logprobs(policy: TrainablePolicy, batch: PackedBatch | None, how: StepSettings,
                     temperature: float) -> torch.Tensor | None:
    """[N] the current policy's log-probs at the batch's loss positions (0
    elsewhere): the old log-probs of PPO epochs, taken once before the first
    update, micro-batch by micro-batch, in lockstep with the other ranks."""
    if batch is None:
        out, plan = None, []
    else:
        out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
        plan = micro_batch_plan(batch, how.micro_batch_tokens, policy.lm.shares_prefixes, loss_only=True)
    micros = [(micro_batch(batch, ix, policy.lm.shares_prefixes), batch.token_positions(ix)) for ix in plan]
    for item, padding in lockstep(micros, how.device):
        micro, positions = (item, None) if padding else item
        hidden = policy.lm.hidden_states(micro)  # a padding pass too: FSDP's collectives pair up
        if not padding:
            out[positions] = current_logprobs(policy.lm, micro, how.path, temperature, hidden)
    return out


@dataclasses.dataclass(frozen=True)
class _LossPass:
    """Forward, loss and backward of one micro-batch, as `accumulate_gradients` runs them."""
    policy: TrainablePolicy
    settings: RLLossSettings
    path: LossPath
    total: int  # the loss's normaliser over every rank's batch
    tis_cap: float | None
    agreement: Agreement | None
    # Until the first optimizer step the policy is its reference, computing
    # exactly like it (tests/training/test_precision.py): the reference's
    # log-probs are then the policy's own, read off this pass's hidden states
    # by one LM-head pass over the loss rows instead of a second decoder pass.
    own_reference: bool

    def backward(self, micro: PackedBatch, padding: bool) -> tuple[torch.Tensor, dict, float]:
        """The micro-batch's loss, its statistics and its accumulation weight
        (0 for a padding pass), after its backward."""
        settings, lm = self.settings, self.policy.lm
        if settings.beta > 0 and not self.own_reference:
            micro = dataclasses.replace(
                micro, ref_logp=reference_logprobs(self.policy, micro, self.path, settings.temperature))
        hidden = lm.hidden_states(micro)
        # This pass's own log-probs, taken once: the reference's (above) and,
        # on-policy, the pre-update ones of TIS and the agreement.
        own_logp = current_logprobs(lm, micro, self.path, settings.temperature, hidden) if self.own_reference else None
        if self.own_reference:
            micro = dataclasses.replace(micro, ref_logp=own_logp)
        weights = None
        if not padding and micro.engine_logp is not None and (self.tis_cap is not None or self.agreement is not None):
            weights = self._engine_correction(micro, hidden, own_logp)
        weight = 0.0 if padding else accumulation_weight(micro, None, settings.loss_type, total=self.total)
        loss, stats = rl_loss(lm, micro, settings, self.path, hidden=hidden, token_weights=weights)
        (loss * weight).backward()
        return loss, stats, weight

    def _engine_correction(self, micro: PackedBatch, hidden: torch.Tensor,
                           own_logp: torch.Tensor | None) -> torch.Tensor | None:
        """The truncated importance weights of the micro-batch's tokens (with a
        cap), after adding their pre-update log-probs to the agreement."""
        old = micro.old_logp
        if old is None:
            old = own_logp if own_logp is not None else current_logprobs(
                self.policy.lm, micro, self.path, self.settings.temperature, hidden)
        weights = None
        if self.tis_cap is not None:
            weights = tis_weights(old, micro.engine_logp, self.tis_cap, micro.loss_mask)
        if self.agreement is not None:
            self.agreement.add(micro, old, self.tis_cap)
        return weights


def _token_counts(policy: TrainablePolicy, batch: PackedBatch | None, micros: Sequence[PackedBatch],
                  loss_type: str) -> dict[str, float]:
    """TOKEN_COUNTS and the loss's normaliser, summed over ranks."""
    local = {"loss_tokens": 0, "batch_tokens": 0, "forward_tokens": 0, "normaliser": 0}
    if batch is not None:
        local = {"loss_tokens": batch.num_loss_tokens, "batch_tokens": batch.num_tokens,
                 "forward_tokens": sum(forwarded_tokens(m, policy.lm.shares_prefixes) for m in micros),
                 "normaliser": loss_normaliser(batch, loss_type)}
    return distributed.all_reduce_sum(local)


def accumulate_gradients(policy: TrainablePolicy, batch: PackedBatch | None, how: StepSettings,
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
    # Balanced on the tokens each forward computes (with prefix sharing a
    # group's prompt counts once per micro-batch).
    micros = [] if batch is None else micro_batches(batch, how.micro_batch_tokens, policy.lm.shares_prefixes,
                                                    loss_only=True)
    counts = _token_counts(policy, batch, micros, settings.loss_type)
    if tis_cap is not None and any(m.engine_logp is None for m in micros):
        raise ValueError("grpo.tis_cap needs the engine's log-probs of every sampled token; "
                         "this batch's rollouts came without them")
    # The keys every rank's losses report, set before the passes: a rank with
    # padding passes only must reduce the same keys as the others.
    sums = dict.fromkeys(("loss", "clip_frac", "entropy") + (("kl",) if settings.beta > 0 else ()), 0.0)
    one = _LossPass(policy, settings, how.path, round(counts["normaliser"]), tis_cap, agreement,
                    own_reference=settings.beta > 0 and policy.equals_reference)
    summing = None if rcgrpo_kernels.get_loss_type(settings.loss_type).divides else max(counts["loss_tokens"], 1)
    for micro, padding in lockstep(micros, how.device):
        loss, stats, weight = one.backward(micro, padding)
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


def _no_gradient(policy: TrainablePolicy, batch: PackedBatch | None, advantages: torch.Tensor,
                 settings: RLLossSettings) -> bool:
    """The update's gradient is exactly zero on every rank (`rl_update`'s skip)."""
    local_tokens = 0 if batch is None else batch.num_loss_tokens
    if distributed.all_reduce_max(local_tokens) == 0:
        return True
    any_advantage = distributed.all_reduce_max(int(bool(advantages.ne(0).any())))
    kl_has_gradient = settings.beta > 0 and not policy.equals_reference
    return not any_advantage and not kl_has_gradient


def _add_pass(totals: dict[str, float], stats: dict[str, float], epoch: int, update: UpdateSettings) -> None:
    """One optimizer step's statistics into the update's totals."""
    for key in ("loss", "clip_frac", "kl", "entropy"):
        if key in stats:
            totals[key] += stats[key]
    if update.updates_per_batch > 1:
        totals[f"clip_frac_pass{epoch + 1}"] += stats.get("clip_frac", 0.0) / update.mini_batches
    if epoch == 0:
        for key in TOKEN_COUNTS:
            totals[key] += stats[key]


def _passes(policy: TrainablePolicy, batch: PackedBatch | None, how: StepSettings, settings: RLLossSettings,
            update: UpdateSettings, step: int, agreement: Agreement,
            take_step) -> tuple[dict[str, float], list]:
    """Every pass over the batch's mini-batches, each followed by
    `take_step()` (its grad norm): the totals of their statistics and the
    norms, one per mini-batch that had loss tokens."""
    totals: dict[str, float] = defaultdict(float)
    norms = []
    for epoch in range(update.updates_per_batch):
        parts = mini_batch_split(batch, update.mini_batches, update.seed * 1_000_003 + step * 101 + epoch)
        for part in parts:
            stats = accumulate_gradients(policy, part, how, settings, update.tis_cap,
                                         agreement if update.on_policy else None)
            if not stats["loss_tokens"]:
                continue  # a mini-batch left without groups on every rank: no step to take
            norms.append(take_step())
            _add_pass(totals, stats, epoch, update)
    return totals, norms


def rl_update(policy: TrainablePolicy, trajectories: Sequence[Trajectory], how: StepSettings,
              settings: RLLossSettings, update: UpdateSettings, *, optimizer=None, scheduler=None, step: int = 0,
              parity: ParityOracle | None = None) -> dict[str, float]:
    """The update from one rollout batch: `updates_per_batch` passes, each of
    `mini_batches` optimizer steps (`optimizer`, `scheduler`). Without an
    optimizer (on-policy only) the gradient of its one pass is left on the
    parameters for the caller: no clip, no step, no `grad_norm`. Off-policy (more than one step) the old
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
    if optimizer is None and not update.on_policy:
        raise ValueError("an update of several optimizer steps needs the optimizer")
    policy.train_mode(dropout=False)
    batch, advantages = prepare_batch(trajectories, how.device, update.advantage_estimator,
                                      update.informative_only)
    out: dict[str, float] = {**advantage_stats(advantages), "updates": 0, "update_skipped": 1}
    if _no_gradient(policy, batch, advantages, settings):
        return out
    out["update_skipped"] = 0
    if parity is not None and parity.due(step + 1):
        # Before the old log-probs and the first update: every pass of the step uses the checked forward.
        micros = [] if batch is None else micro_batches(batch, how.micro_batch_tokens, policy.lm.shares_prefixes,
                                                        loss_only=True)
        out.update(parity.check(step + 1, micros))
    agreement = Agreement()
    if not update.on_policy:
        old = trainer_logprobs(policy, batch, how, settings.temperature)
        if batch is not None:
            batch = dataclasses.replace(batch, old_logp=old)
            agreement.add(batch, old, update.tis_cap)
    take_step = ((lambda: clip_and_step(policy, optimizer, scheduler, update.max_grad_norm))
                 if optimizer is not None else (lambda: None))
    totals, norms = _passes(policy, batch, how, settings, update, step, agreement, take_step)
    n = len(norms)
    out.update({k: (v if k.startswith("clip_frac_pass") or k.endswith("_tokens") else v / n)
                for k, v in totals.items()})
    for key in TOKEN_COUNTS:
        out[key] = round(out[key])
    out.update(agreement.summary(update.tis_cap is not None))
    if optimizer is not None:
        out.update(updates=n, grad_norm=sum(norms) / n)
    return out
