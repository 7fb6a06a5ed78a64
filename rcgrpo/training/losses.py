"""Losses on a packed batch, on one of two loss paths chosen once by name.

Each takes a `PackedLM` (the policy's `policy.lm`, or its reference): final
hidden states and the LM-head weight in the compute dtype, and a `LossPath`,
looked up in LOSS_PATHS by name (`loss_path(run.fused)`: the stages choose
it once). "fused" (`--fused`): the hidden states go straight into
`rcgrpo_kernels.fused_linear_*`, which project only the loss rows onto the
vocabulary, chunk by chunk (Triton on CUDA, chunked PyTorch on CPU), never
building [N, V] logits. "reference": full logits and the plain PyTorch ops in
`rcgrpo_kernels.reference`. Both compute the same numbers
(tests/training/test_train_steps.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import rcgrpo_kernels
from rcgrpo.model.packing import PackedBatch
from rcgrpo.model.policy import PackedLM, TrainablePolicy


@dataclass(frozen=True)
class RLLossSettings:
    """The RL loss's settings (GrpoConfig's, without the rest of the config);
    see rcgrpo_kernels.grpo_loss for each."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.1
    temperature: float = 1.0
    loss_type: str = "grpo"
    max_tokens: float | None = None  # the constant of the loss types scaled by a token budget
    kl_estimator: str = "k3"
    clip_ratio_c: float | None = None  # dual clip; None = off
    log_ratio_clamp: float | None = None
    kl_clamp: float | None = None

    @classmethod
    def from_config(cls, g) -> "RLLossSettings":
        # A token budget, where the loss type divides by one: the trajectory's.
        budget = float(g.max_total_tokens) if rcgrpo_kernels.get_loss_type(g.loss_type).scaled_by_max_tokens else None
        return cls(g.eps_low, g.eps_high, g.beta, g.temperature, g.loss_type, budget, g.kl_estimator,
                   g.clip_ratio_c, g.log_ratio_clamp, g.kl_clamp)

    def kernel_kwargs(self) -> dict:
        """The keyword arguments every kernels loss takes from these settings."""
        return dict(eps_low=self.eps_low, eps_high=self.eps_high, beta=self.beta, loss_type=self.loss_type,
                    max_tokens=self.max_tokens, kl_estimator=self.kl_estimator, clip_ratio_c=self.clip_ratio_c,
                    log_ratio_clamp=self.log_ratio_clamp, kl_clamp=self.kl_clamp)


class LossPath:
    """How the losses go from final hidden states to log-probs and the RL
    loss. One instance per name in LOSS_PATHS."""
    name: str

    def token_logprobs(self, lm: PackedLM, batch: PackedBatch, hidden: torch.Tensor,
                       temperature: float) -> torch.Tensor:
        """[M] log-probs of the targets at the M loss positions (in order)."""
        raise NotImplementedError

    def rl_loss(self, lm: PackedLM, batch: PackedBatch, hidden: torch.Tensor, settings: RLLossSettings,
                ref: torch.Tensor | None, entropy: bool,
                token_weights: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


class FusedPath(LossPath):
    """Only the loss rows projected onto the vocabulary, chunk by chunk."""
    name = "fused"

    def token_logprobs(self, lm, batch, hidden, temperature):
        mask = batch.loss_mask
        return rcgrpo_kernels.fused_linear_logprobs(hidden[mask], lm.lm_head_weight(), batch.targets[mask], temperature)

    def rl_loss(self, lm, batch, hidden, settings, ref, entropy, token_weights):
        return rcgrpo_kernels.fused_linear_grpo_loss(
            hidden, lm.lm_head_weight(), batch.targets, batch.advantages, batch.loss_mask, batch.cu_seqlens,
            old_logp=batch.old_logp, ref_logp=ref, temperature=settings.temperature, compute_entropy=entropy,
            token_weights=token_weights, **settings.kernel_kwargs(),
        )


class ReferencePath(LossPath):
    """Full [N, V] logits and the plain PyTorch ops."""
    name = "reference"

    def token_logprobs(self, lm, batch, hidden, temperature):
        return rcgrpo_kernels.token_logprobs(lm.logits(hidden), batch.targets, temperature,
                                             impl="reference")[batch.loss_mask]

    def rl_loss(self, lm, batch, hidden, settings, ref, entropy, token_weights):
        logits = lm.logits(hidden).float() / settings.temperature
        logp = rcgrpo_kernels.token_logprobs(logits, batch.targets, 1.0, impl="reference")
        loss, stats = rcgrpo_kernels.grpo_loss(
            logp, batch.old_logp, ref, batch.advantages, batch.loss_mask, batch.cu_seqlens,
            token_weights=token_weights, impl="reference", **settings.kernel_kwargs(),
        )
        if entropy:
            with torch.no_grad():
                masked = logits[batch.loss_mask]
                p = masked.softmax(-1)
                stats = dict(stats, entropy=-(p * masked.log_softmax(-1)).sum(-1).mean()
                             if masked.numel() else torch.zeros(()))
        return loss, stats


LOSS_PATHS: dict[str, LossPath] = {path.name: path for path in (FusedPath(), ReferencePath())}


def loss_path(fused: bool) -> LossPath:
    """The run's loss path: `run.fused` names it."""
    return LOSS_PATHS["fused" if fused else "reference"]


def token_logprobs(lm: PackedLM, batch: PackedBatch, path: LossPath, temperature: float = 1.0,
                   hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[M] log-probs of the targets at the M loss positions (in order).
    `hidden` reuses final hidden states already computed for this batch."""
    hidden = lm.hidden_states(batch) if hidden is None else hidden
    return path.token_logprobs(lm, batch, hidden, temperature)


def sft_loss(lm: PackedLM, batch: PackedBatch, path: LossPath,
             hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean negative log-likelihood of the generated (assistant) tokens."""
    logp = token_logprobs(lm, batch, path, hidden=hidden)
    if logp.numel() == 0:
        return logp.sum(), {"nll": 0.0, "loss_tokens": 0}
    nll = -logp.mean()
    return nll, {"nll": float(nll.detach()), "loss_tokens": int(logp.numel())}


@torch.no_grad()
def reference_logprobs(policy: TrainablePolicy, batch: PackedBatch, path: LossPath, temperature: float,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[N] log-probs of the policy's frozen reference, 0 off the loss positions."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    with policy.reference() as ref:
        out[batch.loss_mask] = token_logprobs(ref, batch, path, temperature, hidden).float()
    return out


@torch.no_grad()
def current_logprobs(lm: PackedLM, batch: PackedBatch, path: LossPath, temperature: float,
                     hidden: torch.Tensor) -> torch.Tensor:
    """[N] the policy's log-probs at the loss positions (0 elsewhere) from final
    hidden states already computed (one LM-head pass over the loss rows only,
    no decoder pass): the trainer's side of the engine/trainer agreement."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device)
    out[batch.loss_mask] = token_logprobs(lm, batch, path, temperature, hidden.detach()).float()
    return out


def rl_loss(lm: PackedLM, batch: PackedBatch, settings: RLLossSettings, path: LossPath,
            entropy: bool = True, hidden: torch.Tensor | None = None,
            token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO loss with the KL estimator's penalty to `batch.ref_logp`
    (when beta > 0).

    `batch.old_logp` None means the rollouts came from the current weights
    (one update per rollout batch): ratio 1, gradient -A, as in GRPO.
    `token_weights` [N] multiplies each token's loss (truncated importance
    sampling; no gradient).
    """
    if batch.advantages is None:
        raise ValueError("attach group advantages to the batch before the loss")
    ref = batch.ref_logp if settings.beta > 0 else None
    hidden = lm.hidden_states(batch) if hidden is None else hidden
    return path.rl_loss(lm, batch, hidden, settings, ref, entropy, token_weights)
