"""The clipped GRPO objective over per-token log-probs [N].

One program per BLOCK tokens of the packed batch (1-D grid). Each token finds
its sequence by binary search on cu_seqlens, reads that sequence's advantage
and reduction weight, and writes its weighted loss and d loss / d logp in the
same pass; backward() only rescales the saved derivative. Per-token outputs
are summed by torch (deterministic, unlike atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import loss_types, packing
from ..objective import Objective
from .common import grpo_token, interpreting, search_iters, sequence_of


@triton.jit
def _grpo_loss_kernel(LOGP, OLD, REF, MASK, CU, ADV, WSEQ, TOKW, LOSS_TOK, DLOGP, CLIP_TOK, DUAL_TOK, KL_TOK,
                      N, S, eps_low, eps_high, beta, clip_c, lr_clamp, stat_clamp, kl_clamp, kl_value, kl_grad,
                      HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_TOKW: tl.constexpr,
                      DUAL_CLIP: tl.constexpr, N_ITERS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    counted = ok & (tl.load(MASK + offs, mask=ok, other=0) != 0)
    logp = tl.load(LOGP + offs, mask=ok, other=0.0).to(tl.float32)
    old = logp
    ref = logp
    if HAS_OLD:
        old = tl.load(OLD + offs, mask=counted, other=0.0).to(tl.float32)
    if HAS_REF:
        ref = tl.load(REF + offs, mask=counted, other=0.0).to(tl.float32)
    seq = sequence_of(CU, offs, S, N_ITERS)
    adv = tl.load(ADV + seq, mask=counted, other=0.0).to(tl.float32)
    w = tl.load(WSEQ + seq, mask=counted, other=0.0)
    if HAS_TOKW:  # the caller's per-token weight (e.g. truncated IS) scales the token's whole loss
        w = w * tl.load(TOKW + offs, mask=counted, other=0.0).to(tl.float32)
    # Off the loss tokens every input is pinned (logp to 0, old/ref to it,
    # the advantage and weight to 0), so values there never reach the maths.
    logp = tl.where(counted, logp, 0.0)
    old = tl.where(counted, old, logp)
    ref = tl.where(counted, ref, logp)
    loss, dloss, clipped, dual, kl = grpo_token(logp, old, ref, adv, eps_low, eps_high, beta, clip_c, lr_clamp,
                                                stat_clamp, kl_clamp, kl_value, kl_grad, HAS_OLD, HAS_REF,
                                                DUAL_CLIP)
    tl.store(LOSS_TOK + offs, tl.where(counted, loss * w, 0.0), mask=ok)
    tl.store(DLOGP + offs, tl.where(counted, dloss * w, 0.0), mask=ok)
    tl.store(CLIP_TOK + offs, tl.where(counted & clipped, 1.0, 0.0), mask=ok)
    if DUAL_CLIP:
        tl.store(DUAL_TOK + offs, tl.where(counted & dual, 1.0, 0.0), mask=ok)
    if HAS_REF:
        tl.store(KL_TOK + offs, tl.where(counted, kl, 0.0), mask=ok)


def _block(n: int) -> int:
    # The interpreter runs small blocks so that small test batches span
    # several; past a few thousand tokens the per-program cost dominates.
    return 32 if interpreting() and n <= 4096 else 1024


class GrpoLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, objective, loss_type, max_tokens,
                token_weights):
        n = logp.numel()
        dev = logp.device
        mask = loss_mask.reshape(-1).contiguous()
        counts = packing.loss_token_counts(mask.bool(), cu_seqlens)
        w_seq = loss_types.sequence_weights(counts, loss_type, max_tokens)
        lp = logp.reshape(-1).contiguous()
        # [M] inputs (the loss tokens in order) go back on their packed positions.
        old, ref, tokw = (None if t is None else packing.scatter_per_token(t.detach(), mask.bool()).contiguous()
                          for t in (old_logp, ref_logp, token_weights))
        loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
        dlogp = torch.empty_like(loss_tok)
        clip_tok = torch.empty_like(loss_tok)
        dual_tok = torch.empty_like(loss_tok) if objective.dual_clip else loss_tok
        kl_tok = torch.empty_like(loss_tok) if ref is not None else loss_tok
        if n > 0:
            blk = _block(n)
            _grpo_loss_kernel[(triton.cdiv(n, blk),)](
                lp, old if old is not None else lp, ref if ref is not None else lp,
                mask.view(torch.uint8) if mask.dtype == torch.bool else mask,
                cu_seqlens.contiguous(), advantages.detach().reshape(-1).float().contiguous(), w_seq,
                tokw if tokw is not None else lp,
                loss_tok, dlogp, clip_tok, dual_tok, kl_tok, n, counts.numel(), **objective.triton_args(),
                HAS_OLD=old is not None, HAS_REF=ref is not None, HAS_TOKW=tokw is not None,
                DUAL_CLIP=objective.dual_clip, N_ITERS=search_iters(counts.numel()), BLOCK=blk)
        denom = counts.sum().clamp(min=1).float()
        stats = [clip_tok.sum() / denom]
        if objective.dual_clip:
            stats.append(dual_tok.sum() / denom)
        if ref is not None:
            stats.append(kl_tok.sum() / denom)
        ctx.save_for_backward(dlogp)
        ctx.shape, ctx.dtype = logp.shape, logp.dtype
        ctx.mark_non_differentiable(*stats)
        return (loss_tok.sum(), *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (dlogp,) = ctx.saved_tensors
        return ((dlogp * grad_loss.float()).reshape(ctx.shape).to(ctx.dtype),) + (None,) * 9


def grpo_loss(logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, eps_low=0.2, eps_high=0.2, beta=0.0,
              loss_type="grpo", *, max_tokens=None, token_weights=None, clip_ratio_c=None, kl_estimator="k3",
              log_ratio_clamp=None, kl_clamp=None):
    loss_types.get_loss_type(loss_type)
    objective = Objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp)
    loss, *vals = GrpoLoss.apply(logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, objective,
                                 loss_type, max_tokens, token_weights)
    return loss, dict(zip(objective.stat_keys(ref_logp is not None), vals))
