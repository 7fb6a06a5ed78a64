"""Pieces shared by the Triton kernel families."""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for tiles of ``dtype``.

    fp32 tiles take "tf32x3": each product is split into three tf32 tensor-core
    products (hi*hi + hi*lo + lo*hi), which keeps fp32-level accuracy (the
    promise of every path) at tensor-core speed; "ieee" would run on the FMA
    units at a fraction of that rate, and plain "tf32" would round the inputs
    to 10 mantissa bits. For bf16/fp16 the products are exact in fp32 and the
    option is ignored."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def upcast_for_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must widen bf16 tiles to fp32 before ``tl.dot``.

    Triton 3.9's interpreter returns garbage for a bf16 x bf16 ``tl.dot``
    (fp16 and fp32 are fine); widening is exact, since bf16 products are
    exact in fp32, so interpreter results still match the GPU's. On a GPU
    the bf16 tiles go to the tensor cores as they are.
    """
    return interpreting() and dtype == torch.bfloat16


class Tuner:
    """Chooses one ``triton.Config`` per key by timing every config of the
    key's kind on the call's own inputs, once per key (CUDA only).

    Used instead of ``triton.autotune`` where the launch grid and host-side
    buffers depend on the config (the vocabulary split count of the fused
    sweep does): ``launch(config)`` performs the whole launch, so the timing
    covers exactly what production runs. Launchers must only write their
    outputs (no accumulation), since timing repeats them. ``configs`` maps a
    kind (e.g. the dtype family) to its own list: tiles that fit the
    registers of bf16 dots may spill with tf32x3 or an extra entropy sum
    (tests/kernels/test_kernels_compile.py checks every one).

    Under the interpreter the small ``interp_config`` runs. ``forced`` pins a
    choice everywhere (tests, gpu-check): a Config, used for the kinds that
    list it, or an index i, meaning each kind's i-th config (its last if it
    has fewer). KERNELS_AUTOTUNE=0 takes each kind's first config untimed.
    """

    def __init__(self, configs: dict, interp_config):
        self.configs = {kind: list(cfgs) for kind, cfgs in configs.items()}
        self.interp_config = interp_config
        self.forced = None
        self.best: dict = {}

    def forced_choice(self, kind, forced=...):
        """The config that ``forced`` (default: the tuner's own) pins for ``kind``, or None."""
        f = self.forced if forced is ... else forced
        cfgs = self.configs[kind]
        if isinstance(f, int):
            return cfgs[min(f, len(cfgs) - 1)]
        if f is not None and (f is self.interp_config or any(f is c for c in cfgs)):
            return f
        return None

    def pick(self, kind, key, launch, device: torch.device):
        cfg = self.forced_choice(kind)
        if cfg is not None:
            return cfg
        if interpreting():
            return self.interp_config
        cfgs = self.configs[kind]
        cfg = self.best.get((kind, key))
        if cfg is None:
            if device.type != "cuda" or len(cfgs) == 1 or os.environ.get("KERNELS_AUTOTUNE", "1") == "0":
                cfg = cfgs[0]
            else:
                from triton.testing import do_bench

                times = [do_bench(lambda c=c: launch(c), warmup=5, rep=25) for c in cfgs]
                cfg = cfgs[min(range(len(times)), key=times.__getitem__)]
            self.best[(kind, key)] = cfg
        return cfg

    def run(self, kind, key, launch, device: torch.device):
        """Launch with the config chosen for ``key``; returns what ``launch`` returns."""
        return launch(self.pick(kind, key, launch, device))


def size_bucket(n: int) -> int:
    """log2 bucket of a size: tuned choices are shared within a factor of 2."""
    return max(int(n), 1).bit_length()


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
def kl_base(x, base):
    """The KL base formula ``base`` (an index into ``rcgrpo_kernels.kl_estimators.BASES``:
    k1, abs, k2, k3) at x = logp - ref. Selected by where: no branch per variant."""
    return tl.where(base == 0, x, tl.where(base == 1, tl.abs(x), tl.where(base == 2, 0.5 * x * x,
                                                                          tl.exp(-x) + x - 1.0)))


@triton.jit
def kl_base_grad(x, base):
    """d/dlogp of ``kl_base(x, base)``."""
    sign = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    return tl.where(base == 0, 1.0, tl.where(base == 1, sign, tl.where(base == 2, x, 1.0 - tl.exp(-x))))


@triton.jit
def grpo_token(logp, old, ref, adv, eps_low, eps_high, beta, clip_c, lr_clamp, stat_clamp, kl_clamp, kl_value,
               kl_grad, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, DUAL_CLIP: tl.constexpr):
    """Per-token clipped objective and its derivative w.r.t. logp (fp32).

    Mirrors ``rcgrpo_kernels.objective.token_terms`` (the scalars are
    ``Objective.triton_args``; an unset clamp is +inf): the policy-gradient
    part has derivative 0 exactly where the clipped branch of the min (or the
    dual clip) is active. min/max/clamp propagate NaN, so a NaN input on a
    loss token gives a NaN loss, as on the other paths (Triton's default
    returns the other operand). A clamp's derivative is a 1/0 factor that
    multiplies, so NaN stays NaN there too.
    Returns (loss, dloss, is_clipped, is_dual, kl statistic).
    """
    through = tl.full(logp.shape, 1.0, tl.float32)
    if HAS_OLD:
        x = logp - old
        through = tl.where(tl.abs(x) <= lr_clamp, 1.0, 0.0)
        ratio = tl.exp(tl.clamp(x, -lr_clamp, lr_clamp, propagate_nan=tl.PropagateNan.ALL))
    else:
        ratio = tl.full(logp.shape, 1.0, tl.float32)
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    clipped_ratio = tl.clamp(ratio, lo, hi, propagate_nan=tl.PropagateNan.ALL)
    is_clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    loss = -tl.minimum(ratio * adv, clipped_ratio * adv, propagate_nan=tl.PropagateNan.ALL)
    dloss = tl.where(is_clipped, 0.0, -adv * ratio) * through
    is_dual = is_clipped & False
    if DUAL_CLIP:
        is_dual = (adv < 0) & (ratio > clip_c)
        loss = tl.where(is_dual, -adv * clip_c, loss)
        dloss = tl.where(is_dual, 0.0, dloss)
    kl = tl.zeros_like(logp)
    if HAS_REF:
        d = logp - ref
        stat = kl_base(tl.clamp(d, -stat_clamp, stat_clamp, propagate_nan=tl.PropagateNan.ALL), kl_value)
        kl = tl.clamp(stat, -kl_clamp, kl_clamp, propagate_nan=tl.PropagateNan.ALL)
        if beta != 0.0:  # keeps an infinite KL out of the loss when it is unweighted
            dc = tl.clamp(d, -lr_clamp, lr_clamp, propagate_nan=tl.PropagateNan.ALL)
            value = kl_base(dc, kl_value)
            grad = kl_base_grad(dc, kl_grad) * tl.where(tl.abs(d) <= lr_clamp, 1.0, 0.0)
            grad = grad * tl.where(tl.abs(value) <= kl_clamp, 1.0, 0.0)
            loss = loss + beta * tl.clamp(value, -kl_clamp, kl_clamp, propagate_nan=tl.PropagateNan.ALL)
            dloss = dloss + beta * grad
    return loss, dloss, is_clipped, is_dual, kl
