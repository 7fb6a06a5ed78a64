"""Public entry points: validate, pick an implementation, call it.

``impl=None`` picks Triton for CUDA tensors and the chunked PyTorch path
otherwise; ``impl="reference" | "chunked" | "triton"`` forces one. The
Triton modules are imported only when used, so ``import kernels`` needs no
GPU, and ``TRITON_INTERPRET=1`` set before the first Triton call still takes
effect.

Conventions shared by every function (the packed batch of rcgrpo/batch.py):

- N tokens of S sequences are concatenated; ``cu_seqlens [S+1]`` (int32 or
  int64) holds the boundaries, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == N``.
- Per-token tensors are aligned on the *predicting* position: ``targets[i]``
  is the token that position i predicts (``input_ids[i+1]`` of the same
  sequence) and ``loss_mask[i]`` says whether that prediction is scored.
  The last token of a sequence predicts nothing, so its ``loss_mask`` must be
  False (its target is never read by the losses; for the per-row log-prob
  functions it must still be a valid id, e.g. 0).
  ``next_token_targets(input_ids, loss_mask, cu_seqlens)`` converts the
  packed batch (whose loss_mask marks generated tokens) into this form.
- Inputs may be fp32, bf16 or fp16; arithmetic is fp32 (matmuls accumulate
  in fp32), outputs are fp32 and gradients come back in each input's dtype.
- Gradients flow to ``logits`` / ``hidden`` / ``weight`` / ``bias`` /
  ``logp`` / ``rewards``; ``old_logp``, ``ref_logp``, ``advantages`` and
  ``token_weights`` are treated as constants.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import chunked, loss_types, reference

IMPLS = ("reference", "chunked", "triton")


def _choose(impl: Optional[str], *tensors: Optional[torch.Tensor]) -> str:
    if impl is None:
        on_cuda = any(t is not None and t.is_cuda for t in tensors)
        return "triton" if on_cuda else "chunked"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl == "triton":
        first = next(t for t in tensors if t is not None)
        if not first.is_cuda:
            from .triton.common import interpreting  # imports triton

            if not interpreting():
                raise RuntimeError(
                    "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the first kernel call")
    return impl


def _check_packed(n: int, loss_mask, cu_seqlens, advantages) -> None:
    if loss_mask.numel() != n:
        raise ValueError(f"loss_mask has {loss_mask.numel()} elements, expected N={n}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be 1-D [S+1]")
    if advantages.numel() != cu_seqlens.numel() - 1:
        raise ValueError(
            f"advantages has {advantages.numel()} elements, expected S={cu_seqlens.numel() - 1} (one per sequence)")


def _check_grpo_args(beta, ref_logp, loss_type, eps_low, eps_high) -> None:
    loss_types.get_loss_type(loss_type)
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    if eps_low < 0 or eps_high < 0:
        raise ValueError("eps_low and eps_high must be >= 0")


def _check_token_weights(token_weights, sizes: tuple[int, ...]) -> None:
    if token_weights is not None and token_weights.numel() not in sizes:
        raise ValueError(f"token_weights has {token_weights.numel()} elements, expected one of {sizes} "
                         "(packed positions, or the loss tokens in order)")


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, impl: Optional[str] = None
) -> torch.Tensor:
    """Log-probability of each target token under softmax(logits / temperature).

    Args:
        logits: [N, V] fp32/bf16/fp16.
        targets: [N] int32/int64, every value in [0, V).
        temperature: divides the logits before the softmax.
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        [N] fp32; differentiable w.r.t. ``logits`` (gradient in logits.dtype).
    """
    if logits.dim() != 2 or targets.numel() != logits.shape[0]:
        raise ValueError("expected logits [N, V] and targets [N]")
    which = _choose(impl, logits)
    if which == "reference":
        return reference.token_logprobs(logits, targets, temperature)
    if which == "chunked":
        return chunked.token_logprobs(logits, targets, temperature)
    from .triton import logprob

    return logprob.token_logprobs(logits, targets, temperature)


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: Optional[torch.Tensor] = None,
    *,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Log-probs of ``targets`` under softmax((hidden @ weight.T + bias) / temperature),
    without materialising the [N, V] logits (chunked and Triton paths).

    Every row is scored; to score only loss tokens, pass ``hidden[mask]`` and
    ``targets[mask]``. Typical use: ``old_logp`` / ``ref_logp`` under no_grad.

    Args:
        hidden: [N, H] fp32/bf16/fp16, final hidden states.
        weight: [V, H] lm_head weight, same dtype family.
        targets: [N] int32/int64 in [0, V).
        temperature: divides the logits.
        bias: optional [V].
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        [N] fp32; differentiable w.r.t. hidden, weight and bias.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError("expected hidden [N, H] and weight [V, H]")
    which = _choose(impl, hidden, weight)
    if which == "reference":
        return reference.fused_linear_logprobs(hidden, weight, targets, temperature, bias)
    if which == "chunked":
        return chunked.fused_linear_logprobs(hidden, weight, targets, temperature, bias)
    from .triton import fused_linear_logprob

    return fused_linear_logprob.fused_linear_logprobs(hidden, weight, targets, temperature, bias)


def group_advantages(
    rewards: torch.Tensor,
    seq_group: torch.Tensor,
    eps: float = 1e-6,
    scale: str = "group",
    *,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Group-relative advantages ``(R - mean_g) / (std_g + eps)``.

    Statistics are per group of sequences sharing a ``seq_group`` id; std is
    the population std (ddof=0). A group whose rewards are all equal (or a
    group of one) gets advantages of exactly 0, never NaN.

    Args:
        rewards: [S] fp32/bf16/fp16, one scalar reward per sequence.
        seq_group: [S] integer group id per sequence (any values).
        eps: added to the std.
        scale: "group" divides by (std + eps); "none" only centres (Dr. GRPO).
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        [S] fp32; differentiable w.r.t. rewards.
    """
    if rewards.numel() != seq_group.numel():
        raise ValueError("rewards and seq_group must both be [S]")
    which = _choose(impl, rewards)
    if which == "reference":
        return reference.group_advantages(rewards, seq_group, eps, scale)
    if which == "chunked":
        return chunked.group_advantages(rewards, seq_group, eps, scale)
    from .triton import advantage

    return advantage.group_advantages(rewards, seq_group, eps, scale)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: Optional[torch.Tensor],
    ref_logp: Optional[torch.Tensor],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    loss_type: str = "grpo",
    *,
    max_tokens: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
    impl: Optional[str] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO objective from per-token log-probs.

    Per loss token: ``r = exp(logp - old_logp)``,
    ``l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * k3``, with
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` and A the advantage of the
    token's sequence (found through ``cu_seqlens``). With ``token_weights``,
    each token's ``l`` is multiplied by its weight ``c`` before the reduction
    (``c * l``; the reduction's counts do not change): the hook for truncated
    importance sampling, ``c = min(exp(old_logp - sampler_logp), cap)``.

    Reductions (``loss_type``, a name in ``kernels.LOSS_TYPES``; each is
    defined once in ``kernels/loss_types.py``, where new ones are registered):
        grpo: mean over the loss tokens of each sequence, then mean over the
            sequences that have at least one loss token;
        bnpo, dapo: sum over loss tokens / number of loss tokens (the two are
            the same on one process);
        dr_grpo: sum over loss tokens / (S * max_tokens), S counting every
            sequence; ``max_tokens`` defaults to the largest number of loss
            tokens in one sequence of this batch (pass a constant, e.g. the
            generation budget, to make it batch-independent).
    With no loss token at all the loss is 0.

    Args:
        logp: [N] log-probs of the current policy (differentiable).
        old_logp: [N] or None; None means the sampling policy is the current
            one (ratio 1, gradient -A).
        ref_logp: [N] or None; needed when beta != 0.
        advantages: [S] per-sequence advantages.
        loss_mask: [N] bool.
        cu_seqlens: [S+1] int32/int64.
        eps_low, eps_high: clip range of the ratio.
        beta: weight of the k3 KL penalty.
        loss_type: a name in ``kernels.LOSS_TYPES`` ("grpo", "bnpo", "dapo", "dr_grpo").
        max_tokens: dr_grpo's constant (see above).
        token_weights: None or [N] fp32 per-token loss weights (a constant: no
            gradient flows to it; values off the loss tokens are ignored).
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        (loss, stats): loss is a 0-d fp32 tensor; stats holds 0-d fp32
        tensors, no grad: ``clip_frac`` (share of loss tokens whose ratio was
        clipped in the direction the advantage pushes it) and, when
        ``ref_logp`` is given, ``kl`` (mean k3 over loss tokens).
    """
    _check_packed(logp.numel(), loss_mask, cu_seqlens, advantages)
    _check_grpo_args(beta, ref_logp, loss_type, eps_low, eps_high)
    _check_token_weights(token_weights, (logp.numel(),))
    which = _choose(impl, logp)
    args = (logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, eps_low, eps_high, beta, loss_type)
    kw = dict(max_tokens=max_tokens, token_weights=token_weights)
    if which == "reference":
        return reference.grpo_loss(*args, **kw)
    if which == "chunked":
        return chunked.grpo_loss(*args, **kw)
    from .triton import loss

    return loss.grpo_loss(*args, **kw)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    old_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    temperature: float = 1.0,
    loss_type: str = "grpo",
    bias: Optional[torch.Tensor] = None,
    *,
    max_tokens: Optional[float] = None,
    compute_entropy: bool = False,
    token_weights: Optional[torch.Tensor] = None,
    impl: Optional[str] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """lm_head projection + token log-probs + ``grpo_loss`` in one pass.

    Only the rows where ``loss_mask`` is True are projected (the chunked and
    Triton paths gather them first), and the [N, V] logits are never built.
    Same objective, reductions and stats as ``grpo_loss``.

    Args:
        hidden: [N, H] fp32/bf16/fp16 final hidden states of the packed batch.
        weight: [V, H] lm_head weight.
        targets: [N] int32/int64 next-token ids (read only where loss_mask).
        advantages: [S] per-sequence advantages.
        loss_mask: [N] bool.
        cu_seqlens: [S+1] int32/int64.
        old_logp, ref_logp: None, [N] (packed positions) or [M] (already
            gathered over the M loss tokens, in order).
        eps_low, eps_high, beta, loss_type, max_tokens: as in ``grpo_loss``.
        temperature: divides the logits.
        bias: optional [V].
        compute_entropy: also return ``stats["entropy"]``, the mean entropy of
            softmax(logits / T) over loss tokens (not computed otherwise).
        token_weights: None, [N] or [M] per-token loss weights, as in
            ``grpo_loss`` (a constant).
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        (loss, stats) as in ``grpo_loss`` (+ ``entropy`` when asked); loss is
        differentiable w.r.t. hidden, weight and bias.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError("expected hidden [N, H] and weight [V, H]")
    _check_packed(hidden.shape[0], loss_mask, cu_seqlens, advantages)
    _check_grpo_args(beta, ref_logp, loss_type, eps_low, eps_high)
    if token_weights is not None:
        _check_token_weights(token_weights, (hidden.shape[0], int(loss_mask.sum())))
    which = _choose(impl, hidden, weight)
    args = (hidden, weight, targets, advantages, loss_mask, cu_seqlens, old_logp, ref_logp,
            eps_low, eps_high, beta, temperature, loss_type, bias)
    kw = dict(max_tokens=max_tokens, compute_entropy=compute_entropy, token_weights=token_weights)
    if which == "reference":
        return reference.fused_linear_grpo_loss(*args, **kw)
    if which == "chunked":
        return chunked.fused_linear_grpo_loss(*args, **kw)
    from .triton import fused_linear_grpo_loss as fused

    return fused.fused_linear_grpo_loss(*args, **kw)
