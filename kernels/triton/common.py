"""Pieces shared by the Triton kernel families."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not be silently truncated to tf32: every path promises
    # fp32 arithmetic. For bf16/fp16 the products are exact in fp32 and the
    # option is ignored.
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_for_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must widen bf16 tiles to fp32 before ``tl.dot``.

    Triton 3.9's interpreter returns garbage for a bf16 x bf16 ``tl.dot``
    (fp16 and fp32 are fine); widening is exact, since bf16 products are
    exact in fp32, so interpreter results still match the GPU's. On a GPU
    the bf16 tiles go to the tensor cores as they are.
    """
    return interpreting() and dtype == torch.bfloat16


def search_iters(num_seqs: int) -> int:
    """Iterations of the in-kernel binary search over ``cu_seqlens``."""
    return max(1, math.ceil(math.log2(max(num_seqs, 1))) + 1)


@triton.jit
def sequence_of(cu_ptr, pos, num_seqs, N_ITERS: tl.constexpr):
    """Index s with cu[s] <= pos < cu[s+1] for each packed position ``pos``:
    a vectorised lower-bound search, so no [B, T] or per-token map is needed."""
    lo = tl.zeros_like(pos)
    hi = tl.zeros_like(pos) + (num_seqs - 1)
    for _ in range(N_ITERS):
        mid = (lo + hi) // 2
        nxt = tl.load(cu_ptr + mid + 1)
        right = nxt <= pos
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def grpo_token(logp, old, ref, adv, eps_low, eps_high, beta, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr):
    """Per-token clipped objective and its derivative w.r.t. logp (fp32).

    Mirrors ``kernels.chunked.grpo_token_terms``: the policy-gradient part has
    derivative 0 exactly where the clipped branch of the min is active.
    Returns (loss, dloss, is_clipped, kl).
    """
    if HAS_OLD:
        ratio = tl.exp(logp - old)
    else:
        ratio = tl.full(logp.shape, 1.0, tl.float32)
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    clipped_ratio = tl.minimum(tl.maximum(ratio, lo), hi)
    is_clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    loss = -tl.minimum(ratio * adv, clipped_ratio * adv)
    dloss = tl.where(is_clipped, 0.0, -adv * ratio)
    kl = tl.zeros_like(logp)
    if HAS_REF:
        d = ref - logp
        ed = tl.exp(d)
        kl = ed - d - 1.0
        if beta != 0.0:  # keeps an infinite KL out of the loss when it is unweighted
            loss = loss + beta * kl
            dloss = dloss + beta * (1.0 - ed)
    return loss, dloss, is_clipped, kl
