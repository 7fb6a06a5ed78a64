"""Group-relative advantages, k (R - mean_g) / d, in one launch (the
estimators and their k and d: ``rcgrpo_kernels/advantage_estimators.py``).

One program per sequence scans all S rewards for the members of its group
(masked, BLOCK at a time). That is O(S^2 / BLOCK) loads, which for the
S <= a few thousand sequences of a GRPO step is far cheaper than a host
round trip to relabel the groups (``torch.unique`` synchronises), and group
ids can be any integers. Two-pass statistics (mean, then squared deviations)
keep the population std accurate; the mean is taken relative to the group's
first reward so that a constant group gets an advantage of exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..advantage_estimators import get_advantage_estimator
from .common import interpreting


@triton.jit
def _group_scan(R, G, S, gi, pivot, mean, BLOCK: tl.constexpr):
    """Sums over the members of group ``gi``: (count, sum(r - pivot), sum((r - mean)^2))."""
    cnt = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK,), tl.float32)
    sq = tl.zeros((BLOCK,), tl.float32)
    for j0 in range(0, S, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < S
        same = ok & (tl.load(G + j, mask=ok, other=0) == gi)
        r = tl.load(R + j, mask=ok, other=0.0).to(tl.float32)
        cnt += tl.where(same, 1.0, 0.0)
        acc += tl.where(same, r - pivot, 0.0)
        sq += tl.where(same, (r - mean) * (r - mean), 0.0)
    return tl.sum(cnt, 0), tl.sum(acc, 0), tl.sum(sq, 0)


@triton.jit
def _adv_fwd_kernel(R, G, OUT, MEAN, STD, S, eps, ddof, loo, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    gi = tl.load(G + i)
    # The group's first member is its pivot, so every member computes the
    # very same mean.
    first = tl.full((BLOCK,), 2147483647, tl.int32)
    for j0 in range(0, S, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < S
        same = ok & (tl.load(G + j, mask=ok, other=0) == gi)
        first = tl.minimum(first, tl.where(same, j, 2147483647))
    pivot = tl.load(R + tl.min(first, 0)).to(tl.float32)
    cnt, shifted, _ = _group_scan(R, G, S, gi, pivot, 0.0, BLOCK)
    mean = pivot + shifted / cnt
    r_i = tl.load(R + i).to(tl.float32)
    adv = r_i - mean
    std = tl.zeros_like(mean)
    if SCALE:
        _, _, sq = _group_scan(R, G, S, gi, pivot, mean, BLOCK)
        std = tl.sqrt(sq / tl.maximum(cnt - ddof, 1.0))
        adv = adv / (std + eps)
    if loo:  # RLOO: R - mean of the others = n / (n - 1) * (R - mean)
        adv = adv * (cnt / tl.maximum(cnt - 1.0, 1.0))
    tl.store(OUT + i, adv)
    tl.store(MEAN + i, mean)
    tl.store(STD + i, std)


@triton.jit
def _adv_bwd_kernel(R, G, GRAD, MEAN, STD, DR, S, eps, ddof, loo, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """dR_i = k [(g_i - mean_g(g)) / (std + eps) - x_i * sum_g(g x) / ((n - ddof) std (std + eps)^2)],
    x = R - mean, k the leave-one-out factor; the second term vanishes for a
    constant group (x == 0) and is absent without the std."""
    i = tl.program_id(0)
    gi = tl.load(G + i)
    mean = tl.load(MEAN + i)
    std = tl.load(STD + i)
    cnt = tl.zeros((BLOCK,), tl.float32)
    gsum = tl.zeros((BLOCK,), tl.float32)
    gx = tl.zeros((BLOCK,), tl.float32)
    for j0 in range(0, S, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < S
        same = ok & (tl.load(G + j, mask=ok, other=0) == gi)
        g = tl.load(GRAD + j, mask=same, other=0.0).to(tl.float32)
        x = tl.load(R + j, mask=same, other=0.0).to(tl.float32) - mean
        cnt += tl.where(same, 1.0, 0.0)
        gsum += g
        gx += tl.where(same, g * x, 0.0)
    n = tl.sum(cnt, 0)
    g_i = tl.load(GRAD + i).to(tl.float32)
    d = g_i - tl.sum(gsum, 0) / n
    if SCALE:
        x_i = tl.load(R + i).to(tl.float32) - mean
        denom = std + eps
        safe_std = tl.where(std > 0, std, 1.0)
        dof = tl.maximum(n - ddof, 1.0)
        d = d / denom - tl.where(std > 0, x_i * tl.sum(gx, 0) / (dof * safe_std * denom * denom), 0.0)
    if loo:
        d = d * (n / tl.maximum(n - 1.0, 1.0))
    tl.store(DR + i, d)


def _block(num: int) -> int:
    return 32 if interpreting() else min(1024, max(32, triton.next_power_of_2(num)))


class GroupAdvantages(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rewards, seq_group, eps, estimator):
        est = get_advantage_estimator(estimator)
        r = rewards.reshape(-1).contiguous()
        g = seq_group.reshape(-1).contiguous()
        s = r.numel()
        out = torch.empty(s, dtype=torch.float32, device=r.device)
        mean = torch.empty_like(out)
        std = torch.empty_like(out)
        # ddof and leave-one-out are run-time scalars: no extra compiled variants.
        consts = (float(est.ddof), int(est.leave_one_out))
        if s > 0:
            _adv_fwd_kernel[(s,)](r, g, out, mean, std, s, eps, *consts, SCALE=est.scale_by_std, BLOCK=_block(s))
        ctx.save_for_backward(r, g, mean, std)
        ctx.eps, ctx.consts, ctx.scale, ctx.dtype = eps, consts, est.scale_by_std, rewards.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        r, g, mean, std = ctx.saved_tensors
        s = r.numel()
        dr = torch.empty(s, dtype=torch.float32, device=r.device)
        if s > 0:
            _adv_bwd_kernel[(s,)](r, g, grad.contiguous(), mean, std, dr, s, ctx.eps, *ctx.consts,
                                  SCALE=ctx.scale, BLOCK=_block(s))
        return dr.to(ctx.dtype), None, None, None


def group_advantages(rewards, seq_group, eps=1e-6, estimator="grpo"):
    get_advantage_estimator(estimator)
    return GroupAdvantages.apply(rewards, seq_group, float(eps), estimator)
