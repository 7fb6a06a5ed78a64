"""Token log-probs from logits: one program per row, online logsumexp over
vocab blocks, target gather and temperature folded into the same pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting


@triton.jit
def _logprob_fwd_kernel(LOGITS, stride_row, TARGETS, LOGP, LSE, V, inv_temp, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 1-D grid over rows: no 65,535 limit
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row).to(tl.int32)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    zt = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, 0))
        # While every logit so far is -inf (a top-k / top-p masked row's
        # leading blocks), -inf - -inf would be NaN: shift by 0 instead.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
        m = m_new
        zt += tl.sum(tl.where(cols == target, z, 0.0), 0)
    lse = m + tl.log(s)
    tl.store(LSE + row, lse)
    tl.store(LOGP + row, zt - lse)


@triton.jit
def _logprob_bwd_kernel(LOGITS, stride_row, TARGETS, LSE, GRAD, DLOGITS, stride_drow, V, inv_temp,
                        BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row).to(tl.int32)
    lse = tl.load(LSE + row)
    g = tl.load(GRAD + row).to(tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        valid = cols < V
        z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        dz = (tl.where(cols == target, 1.0, 0.0) - p) * (g * inv_temp)
        tl.store(DLOGITS + row * stride_drow + cols, dz.to(DLOGITS.dtype.element_ty), mask=valid)


def _block_v(v: int) -> int:
    return 64 if interpreting() else min(4096, triton.next_power_of_2(v))


class TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        n, v = logits.shape
        t = targets.reshape(-1).contiguous()
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        if n > 0:
            _logprob_fwd_kernel[(n,)](logits, logits.stride(0), t, logp, lse, v, 1.0 / temperature,
                                      BLOCK_V=_block_v(v))
        ctx.save_for_backward(logits, t, lse)
        ctx.inv_t = 1.0 / temperature
        return logp

    @staticmethod
    def backward(ctx, grad):
        logits, t, lse = ctx.saved_tensors
        n, v = logits.shape
        dlogits = torch.empty_like(logits)
        if n > 0:
            _logprob_bwd_kernel[(n,)](logits, logits.stride(0), t, lse, grad.contiguous(), dlogits,
                                      dlogits.stride(0), v, ctx.inv_t, BLOCK_V=_block_v(v))
        return dlogits, None, None


def token_logprobs(logits, targets, temperature=1.0):
    return TokenLogprobs.apply(logits, targets, float(temperature))
