"""Public entry points: validate, pick an implementation, call it.

``impl=None`` picks Triton for CUDA tensors and the chunked PyTorch path
otherwise; ``impl="reference" | "chunked" | "triton"`` forces one. The
Triton modules are imported only when used, so ``import rcgrpo_kernels`` needs no
GPU, and ``TRITON_INTERPRET=1`` set before the first Triton call still takes
effect. ``fused_linear_grpo_loss`` checks its settings once into a
``LossSettings`` (``loss_settings.py``), the one object its implementations take.

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

import warnings
from typing import Optional

import torch

from . import advantage_estimators, chunked, loss_settings, loss_types, objective, reference

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


# --------------------------------------------------------------------------
# Validation at the door: every argument of every public function, each a
# one-line ValueError naming the argument, before any kernel runs.
# --------------------------------------------------------------------------
def _tensor(name: str, t, *, dim: Optional[int] = None, kind: str = "float", numel=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if kind == "float" and not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (fp32/bf16/fp16), got {t.dtype}")
    if kind == "int" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor (int32/int64), got {t.dtype}")
    if kind == "mask" and (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"{name} must be a bool (or integer 0/1) tensor, got {t.dtype}")
    if numel is not None and t.numel() not in (numel if isinstance(numel, tuple) else (numel,)):
        want = " or ".join(str(x) for x in (numel if isinstance(numel, tuple) else (numel,)))
        raise ValueError(f"{name} has {t.numel()} elements, expected {want}")


def _same_device(**tensors) -> None:
    devices = {k: t.device for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {where}")


def _check_targets(targets: torch.Tensor, vocab: int, rows: Optional[torch.Tensor] = None) -> None:
    """Targets (those of ``rows`` when given: the only ones read) must be ids
    in [0, V). One host sync. HF's ignore index -100 is not an id: leave such
    positions out of the loss mask (or the rows passed) instead."""
    t = targets.reshape(-1) if rows is None else targets.reshape(-1)[rows]
    if t.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack([t.min(), t.max()]).tolist())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"targets must be token ids in [0, {vocab}) where they are read, got values in "
                         f"[{lo}, {hi}] (an ignore index such as -100 belongs outside the loss mask)")


def _check_packed(n: int, loss_mask, cu_seqlens, advantages) -> None:
    _tensor("loss_mask", loss_mask, kind="mask", numel=n)
    _tensor("cu_seqlens", cu_seqlens, dim=1, kind="int")
    _tensor("advantages", advantages)
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be 1-D [S+1] with S >= 0")
    if advantages.numel() != cu_seqlens.numel() - 1:
        raise ValueError(
            f"advantages has {advantages.numel()} elements, expected S={cu_seqlens.numel() - 1} (one per sequence)")
    cu = cu_seqlens.long()
    ok = (cu[0] == 0) & (cu[-1] == n) & (cu[1:] >= cu[:-1]).all()
    if not bool(ok):  # one host sync
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at N={n}, got "
                         f"{cu_seqlens.tolist() if cu_seqlens.numel() <= 12 else 'a tensor that does not'}")


def _check_linear(hidden, weight, bias):
    """hidden [N, H], weight [V, H], bias None or [V]; returns bias made
    contiguous (the kernels read it with stride 1)."""
    _tensor("hidden", hidden, dim=2)
    _tensor("weight", weight, dim=2)
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] must share H, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is None:
        return None
    _tensor("bias", bias, dim=1, numel=weight.shape[0])
    return bias.contiguous()


def _per_token(name: str, t, n: int, m: int) -> None:
    if t is not None:
        _tensor(name, t, numel=(n, m) if m != n else n)


def _objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp, ref_logp):
    obj = objective.Objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp)
    if obj.beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    return obj


def _max_tokens(loss_type: str, max_tokens) -> None:
    loss_types.get_loss_type(loss_type)
    if max_tokens is not None:
        objective.finite_number("max_tokens", max_tokens, 0.0, strict=True)


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
    _tensor("logits", logits, dim=2)
    _tensor("targets", targets, dim=1, kind="int", numel=logits.shape[0])
    _same_device(logits=logits, targets=targets)
    temperature = objective.finite_number("temperature", temperature, 0.0, strict=True)
    _check_targets(targets, logits.shape[1])
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
    bias = _check_linear(hidden, weight, bias)
    _tensor("targets", targets, dim=1, kind="int", numel=hidden.shape[0])
    _same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    temperature = objective.finite_number("temperature", temperature, 0.0, strict=True)
    _check_targets(targets, weight.shape[0])
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
    estimator: str = "grpo",
    *,
    scale: Optional[str] = None,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Group-relative advantages, ``k (R - mean_g) / d`` (the paper's
    ``(R - mean_g) / (std_g + eps)`` by default).

    Statistics are per group of sequences sharing a ``seq_group`` id. A group
    whose rewards are all equal (or a group of one) gets advantages of
    exactly 0, never NaN, under every estimator.

    Args:
        rewards: [S] fp32/bf16/fp16, one scalar reward per sequence.
        seq_group: [S] integer group id per sequence (any values).
        eps: added to the std (estimators that divide by it).
        estimator: a name in ``rcgrpo_kernels.ADVANTAGE_ESTIMATORS``: "grpo" (population
            std, the paper), "grpo_ddof1" (sample std: verl, TRL), "dr_grpo"
            (centred only), "rloo" (leave-one-out); see
            ``rcgrpo_kernels/advantage_estimators.py``. "group" / "none" name grpo / dr_grpo.
        scale: deprecated spelling of ``estimator`` ("group" or "none").
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        [S] fp32; differentiable w.r.t. rewards.
    """
    if scale is not None:
        warnings.warn("group_advantages(scale=...) is deprecated: pass estimator= ('group' is 'grpo', "
                      "'none' is 'dr_grpo')", DeprecationWarning, stacklevel=2)
        estimator = scale
    advantage_estimators.get_advantage_estimator(estimator)
    _tensor("rewards", rewards, dim=1)
    _tensor("seq_group", seq_group, dim=1, kind="int", numel=rewards.numel())
    _same_device(rewards=rewards, seq_group=seq_group)
    objective.finite_number("eps", eps, 0.0)
    which = _choose(impl, rewards)
    if which == "reference":
        return reference.group_advantages(rewards, seq_group, eps, estimator)
    if which == "chunked":
        return chunked.group_advantages(rewards, seq_group, eps, estimator)
    from .triton import advantage

    return advantage.group_advantages(rewards, seq_group, eps, estimator)


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
    clip_ratio_c: Optional[float] = None,
    kl_estimator: str = "k3",
    log_ratio_clamp: Optional[float] = None,
    kl_clamp: Optional[float] = None,
    impl: Optional[str] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped GRPO objective from per-token log-probs.

    Per loss token (``rcgrpo_kernels/objective.py``): ``r = exp(logp - old_logp)``,
    ``l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * KL``, with
    A the advantage of the token's sequence (found through ``cu_seqlens``)
    and KL the ``kl_estimator`` (default k3, ``exp(ref - logp) - (ref - logp) - 1``).
    With ``clip_ratio_c`` (dual-clip PPO, verl) a negative-advantage token's
    loss is at most ``-clip_ratio_c * A``. With ``token_weights``, each
    token's ``l`` is multiplied by its weight ``c`` before the reduction
    (``c * l``; the reduction's counts do not change): the hook for truncated
    importance sampling, ``c = min(exp(old_logp - sampler_logp), cap)``.

    Reductions (``loss_type``, a name in ``rcgrpo_kernels.LOSS_TYPES``; each is
    defined once in ``rcgrpo_kernels/loss_types.py``, with its verl and TRL names):
        grpo: mean over the loss tokens of each sequence, then mean over the
            sequences that have at least one loss token;
        bnpo, dapo: sum over loss tokens / number of loss tokens (the two are
            the same on one process);
        dr_grpo: sum over loss tokens / (S * max_tokens), S counting every
            sequence; ``max_tokens`` defaults to the largest number of loss
            tokens in one sequence of this batch (pass a constant, e.g. the
            generation budget, to make it batch-independent);
        token-sum: sum over loss tokens; seq-mean-token-sum: that sum / the
            sequences with loss tokens; seq-mean-token-sum-norm: that sum /
            max_tokens (verl's loss_scale_factor).
    With no loss token at all the loss is 0.

    NaN is never hidden: a NaN in ``logp``, ``old_logp``, ``ref_logp``,
    ``advantages`` or ``token_weights`` on a loss token makes the loss NaN on
    every path; values off the loss tokens are never read into the maths.

    Args:
        logp: [N] log-probs of the current policy (differentiable).
        old_logp: None, [N] (packed positions) or [M] (the M loss tokens in
            order); None means the sampling policy is the current one (ratio
            1, gradient -A).
        ref_logp: None, [N] or [M]; needed when beta != 0.
        advantages: [S] per-sequence advantages.
        loss_mask: [N] bool.
        cu_seqlens: [S+1] int32/int64, from 0 to N, never decreasing.
        eps_low, eps_high: clip range of the ratio (>= 0).
        beta: weight of the KL penalty (>= 0).
        loss_type: a name in ``rcgrpo_kernels.LOSS_TYPES``.
        max_tokens: the constant of the types scaled by a token budget.
        token_weights: None, [N] or [M] per-token loss weights (a constant: no
            gradient flows to it; values off the loss tokens are ignored).
        clip_ratio_c: dual-clip bound (> 1; verl's default is 3.0); None = off.
        kl_estimator: a name in ``rcgrpo_kernels.KL_ESTIMATORS`` (k3, k1, k2, abs,
            k1+, abs+, k3+; ``rcgrpo_kernels/kl_estimators.py``).
        log_ratio_clamp: clamp logp - old and logp - ref to [-c, c] (verl: 20);
            None = off (TRL's behaviour).
        kl_clamp: clamp the KL value to [-c, c] (verl: 10 for k3); None = off.
        impl: None (auto), "reference", "chunked" or "triton".

    Returns:
        (loss, stats): loss is a 0-d fp32 tensor; stats holds 0-d fp32
        tensors, no grad: ``clip_frac`` (share of loss tokens whose ratio was
        clipped in the direction the advantage pushes it), with the dual clip
        ``clip_frac_lower`` (share held by it), and, when ``ref_logp`` is
        given, ``kl`` (mean of the estimator over loss tokens, its log-ratio
        clamped to +-20 so that a -inf log-prob gives a finite number).
    """
    _tensor("logp", logp, dim=1)
    n = logp.numel()
    _check_packed(n, loss_mask, cu_seqlens, advantages)
    obj = _objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp, ref_logp)
    _max_tokens(loss_type, max_tokens)
    m = int(loss_mask.sum()) if any(t is not None for t in (old_logp, ref_logp, token_weights)) else n
    _per_token("old_logp", old_logp, n, m)
    _per_token("ref_logp", ref_logp, n, m)
    _per_token("token_weights", token_weights, n, m)
    _same_device(logp=logp, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, loss_mask=loss_mask,
                 cu_seqlens=cu_seqlens, token_weights=token_weights)
    which = _choose(impl, logp)
    args = (logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, obj.eps_low, obj.eps_high, obj.beta,
            loss_type)
    kw = dict(max_tokens=max_tokens, token_weights=token_weights, clip_ratio_c=clip_ratio_c,
              kl_estimator=kl_estimator, log_ratio_clamp=log_ratio_clamp, kl_clamp=kl_clamp)
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
    clip_ratio_c: Optional[float] = None,
    kl_estimator: str = "k3",
    log_ratio_clamp: Optional[float] = None,
    kl_clamp: Optional[float] = None,
    impl: Optional[str] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """lm_head projection + token log-probs + ``grpo_loss`` in one pass.

    Only the rows where ``loss_mask`` is True are projected (every path
    gathers them first), and the [N, V] logits are never built. Same
    objective, reductions, settings and stats as ``grpo_loss``.

    Args:
        hidden: [N, H] fp32/bf16/fp16 final hidden states of the packed batch.
        weight: [V, H] lm_head weight.
        targets: [N] int32/int64 next-token ids, in [0, V) where loss_mask is
            True (only those are read; e.g. -100 elsewhere is fine).
        advantages: [S] per-sequence advantages.
        loss_mask: [N] bool.
        cu_seqlens: [S+1] int32/int64.
        old_logp, ref_logp: None, [N] (packed positions) or [M] (already
            gathered over the M loss tokens, in order).
        eps_low, eps_high, beta, loss_type, max_tokens, clip_ratio_c,
        kl_estimator, log_ratio_clamp, kl_clamp: as in ``grpo_loss``.
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
    bias = _check_linear(hidden, weight, bias)
    n = hidden.shape[0]
    _tensor("targets", targets, dim=1, kind="int", numel=n)
    _check_packed(n, loss_mask, cu_seqlens, advantages)
    obj = _objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp, ref_logp)
    settings = loss_settings.LossSettings(obj, loss_type, max_tokens, temperature, compute_entropy)
    m = int(loss_mask.sum())
    _per_token("old_logp", old_logp, n, m)
    _per_token("ref_logp", ref_logp, n, m)
    _per_token("token_weights", token_weights, n, m)
    _same_device(hidden=hidden, weight=weight, targets=targets, advantages=advantages, loss_mask=loss_mask,
                 cu_seqlens=cu_seqlens, old_logp=old_logp, ref_logp=ref_logp, bias=bias, token_weights=token_weights)
    _check_targets(targets, weight.shape[0], rows=loss_mask.reshape(-1).bool())
    which = _choose(impl, hidden, weight)
    args = (hidden, weight, targets, advantages, loss_mask, cu_seqlens, old_logp, ref_logp, bias, token_weights)
    if which == "reference":
        return reference.fused_linear_grpo_loss(*args, settings=settings)
    if which == "chunked":
        return chunked.fused_linear_grpo_loss(*args, settings=settings)
    from .triton import fused_linear_grpo_loss as fused

    return fused.fused_linear_grpo_loss(*args, settings=settings)
