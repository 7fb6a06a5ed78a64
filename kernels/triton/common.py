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
