"""TRL's GRPOTrainer with its loss computed by `rcgrpo_kernels.fused_linear_grpo_loss`.

Installed with the kernels (`pip install './rcgrpo_kernels[trl]'`, or the
trainer's `trl` extra); it needs only `torch`, `trl==1.16.0` and the kernels.
Use `KernelGRPOTrainer` wherever you used `GRPOTrainer`; nothing else changes:

    from rcgrpo_kernels.trl_grpo import KernelGRPOTrainer
    trainer = KernelGRPOTrainer(model=..., reward_funcs=..., train_dataset=...,
                                args=GRPOConfig(loss_type="dapo", beta=0.04, use_bias_correction_kl=False, ...))
    trainer.train()

What changes is only the loss pass of each micro-batch (`_compute_loss`):
the decoder runs as before, then its last hidden states at the scored
completion positions go with the LM-head weight into one fused kernel that
projects only those rows (Triton on CUDA, chunked PyTorch on CPU), takes
their log-probs and returns the clipped GRPO loss and its statistics; the
[B, T, V] logits are never built, and prompt and padding rows are not
projected at all. Generation, rewards, advantages and the old and reference
log-probs stay TRL's own.

How TRL 1.16's loss maps onto the kernel's arguments (tests/integrations/test_trl_grpo.py checks loss and
gradients against TRL's own `_compute_loss`):

- the packed batch: each completion row of the [B, T] batch is one sequence
  of T tokens (`cu_seqlens = 0, T, 2T, ...`); `loss_mask` is
  `completion_mask` (times `tool_mask` in tool-calling runs);
- `old_per_token_logps` -> `old_logp` (absent: the ratio is 1, as TRL's
  `per_token_logps.detach()`); `ref_per_token_logps` -> `ref_logp`;
  `beta`, `epsilon_low/high` -> `beta`, `eps_low/high`; `temperature`;
- the reductions, each then scaled by what TRL's differs by:
  grpo: TRL averages over all B rows, the kernel over rows with a loss token
  (x rows-with-tokens / B), and TRL divides by the gradient-accumulation
  steps (/ GA); bnpo: same token mean (/ GA); dr_grpo: `max_tokens =
  max_completion_length` (/ GA); dapo: the kernel's local token mean becomes
  TRL's sum / (global loss tokens per accumulation window)
  (x local tokens / TRL's normaliser);
- vLLM truncated importance sampling (`importance_sampling_ratio`) ->
  `token_weights`. TRL weights only the clipped term with it, the kernel
  weights a token's whole loss, so with beta > 0 the KL term is a second
  fused call with zero advantages (its clipped term is then 0).

Where the definitions would differ, this trainer refuses the setting at
construction instead of computing something else: loss types other than
grpo / bnpo / dr_grpo / dapo (cispo, sapo, luspo, vespo), sequence-level
importance sampling, two-sided clipping (`delta`), the ratio-weighted KL
(`use_bias_correction_kl`), entropy masking (`top_entropy_quantile < 1`),
the entropy bonus, the off-policy sequence mask, MoE auxiliary losses,
logit soft-capping or scaling, and vision inputs. Logged metrics: `kl`,
`entropy` and `clip_ratio/region_mean` (TRL's names), averaged over
processes per micro-batch.
"""
from __future__ import annotations

import torch
from trl import GRPOTrainer

import rcgrpo_kernels

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def unsupported_settings(trainer: GRPOTrainer) -> list[str]:
    """The trainer's settings this loss does not compute as TRL defines them."""
    args = trainer.args
    text_config = trainer.model.config.get_text_config()
    found = []
    if trainer.loss_type not in SUPPORTED_LOSS_TYPES:
        found.append(f"loss_type={trainer.loss_type!r} (supported: {', '.join(SUPPORTED_LOSS_TYPES)})")
    if trainer.importance_sampling_level != "token":
        found.append(f"importance_sampling_level={trainer.importance_sampling_level!r}")
    if args.delta is not None:
        found.append("delta (two-sided clipping)")
    if trainer.beta != 0.0 and args.use_bias_correction_kl:
        found.append("use_bias_correction_kl")
    if trainer.top_entropy_quantile < 1.0:
        found.append("top_entropy_quantile < 1 (entropy masking)")
    if trainer._entropy_bonus_enabled:
        found.append("entropy_coef / adaptive entropy (entropy bonus)")
    if trainer.off_policy_mask_threshold is not None:
        found.append("off_policy_mask_threshold")
    if trainer.aux_loss_enabled:
        found.append("MoE router auxiliary loss")
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        found.append("final_logit_softcapping")
    for scale in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(text_config, scale, None) not in (None, 1.0):
            found.append(scale)
    return found


class KernelGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose loss is `rcgrpo_kernels.fused_linear_grpo_loss` (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        found = unsupported_settings(self)
        if found:
            raise ValueError("KernelGRPOTrainer does not compute these settings as TRL does; use GRPOTrainer: "
                             + "; ".join(found))

    def _compute_loss(self, model, inputs):
        if inputs["advantages"].dim() != 1 or inputs.get("pixel_values") is not None:
            raise ValueError("KernelGRPOTrainer takes text-only batches with one advantage per completion")
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        batch, width = completion_ids.shape

        lm = self._causal_lm(model)
        hidden = self._completion_hidden_states(lm, inputs)  # [B*T, H]
        head = lm.get_output_embeddings()

        loss_mask = mask.bool().reshape(-1)
        cu_seqlens = torch.arange(0, (batch + 1) * width, width, device=hidden.device, dtype=torch.int32)
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        common = dict(hidden=hidden, weight=head.weight, targets=completion_ids.reshape(-1),
                      loss_mask=loss_mask, cu_seqlens=cu_seqlens,
                      old_logp=None if old is None else old.reshape(-1),
                      eps_low=self.epsilon_low, eps_high=self.epsilon_high, temperature=self.temperature,
                      loss_type=self.loss_type, bias=head.bias,
                      max_tokens=(float(self.max_completion_length)
                                  if rcgrpo_kernels.get_loss_type(self.loss_type).scaled_by_max_tokens else None))
        ref_flat = None if ref is None else ref.reshape(-1)
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs.get("importance_sampling_ratio")
        advantages = inputs["advantages"].float()
        if is_ratio is None:
            loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(
                advantages=advantages, ref_logp=ref_flat, beta=self.beta, compute_entropy=True, **common)
        else:
            weights = is_ratio.expand_as(mask).reshape(-1).float()
            loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(
                advantages=advantages, token_weights=weights, compute_entropy=True, **common)
            if ref_flat is not None:
                kl_loss, kl_stats = rcgrpo_kernels.fused_linear_grpo_loss(
                    advantages=torch.zeros_like(advantages), ref_logp=ref_flat, beta=self.beta, **common)
                loss = loss + kl_loss
                stats["kl"] = kl_stats["kl"]

        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            rows_with_tokens = (mask.sum(-1) > 0).sum()
            loss = loss * rows_with_tokens / batch / accumulation
        elif self.loss_type in ("bnpo", "dr_grpo"):
            loss = loss / accumulation
        else:  # dapo: TRL's normaliser is the window's loss tokens over every process
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normaliser = normaliser * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            loss = loss * loss_mask.sum().clamp(min=1) / normaliser

        metrics = self._metrics[mode]
        names = {"kl": "kl", "entropy": "entropy", "clip_frac": "clip_ratio/region_mean"}
        for key, name in names.items():
            if key in stats:
                metrics[name].append(self.accelerator.gather(stats[key].reshape(1)).mean().item())
        return loss

    def _causal_lm(self, model):
        """The causal LM under accelerate's and PEFT's wrappers (a PEFT
        model's adapters live inside it, so its backbone still runs them)."""
        lm = self.accelerator.unwrap_model(model)
        return lm.get_base_model() if hasattr(lm, "get_base_model") else lm

    def _completion_hidden_states(self, lm, inputs) -> torch.Tensor:
        """[B*T, H] the decoder's last hidden states at the positions that
        predict each completion token (prompt position P-1 up to P+T-2)."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        kwargs = {}
        if inputs.get("token_type_ids") is not None:
            kwargs["token_type_ids"] = inputs["token_type_ids"]
        with self.accelerator.autocast():
            out = lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        p, t = prompt_ids.shape[1], completion_ids.shape[1]
        hidden = out.last_hidden_state[:, p - 1:p + t - 1]
        return hidden.reshape(-1, hidden.shape[-1])
