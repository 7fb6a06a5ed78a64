"""Projection, log-probs, GRPO loss and statistics in one pass over the loss tokens.

Only the rows where loss_mask is True are gathered (before the vocabulary
projection), so prompt and tool-output tokens cost nothing. The shared
split-vocabulary sweep (``fused_linear_logprob.forward_partials``) reads
each gathered token's hidden state against the whole vocabulary once; a
second, tiny launch merges the per-slice partials and applies the clipped
objective: each token finds its sequence by binary search on cu_seqlens and
writes its weighted loss, its d loss / d logp (all backward needs besides
the lse) and its statistics. Backward reuses the fused-linear recompute path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import loss_types, packing
from ..loss_settings import LossSettings
from .common import grpo_token, interpreting, search_iters, sequence_of
from .fused_linear_logprob import as_compute_pair, combine_partials, forward_partials, linear_logprobs_backward


@triton.jit
def _grpo_epilogue_kernel(PM, PS, PZT, PEZ, n_splits, POS, CU, ADV, WSEQ, OLD, REF, TOKW,
                          LSE, COEF, LOSS_TOK, CLIP_TOK, DUAL_TOK, KL_TOK, ENT_TOK, M, S,
                          eps_low, eps_high, beta, clip_c, lr_clamp, stat_clamp, kl_clamp, kl_value, kl_grad,
                          HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_TOKW: tl.constexpr,
                          DUAL_CLIP: tl.constexpr, WANT_ENT: tl.constexpr, N_ITERS: tl.constexpr,
                          BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # 1-D grid over loss tokens
    row_ok = rows < M
    lse, zt, ent = combine_partials(PM, PS, PZT, PEZ, rows, row_ok, M, n_splits, WANT_ENT)
    logp = zt - lse
    pos = tl.load(POS + rows, mask=row_ok, other=0)
    seq = sequence_of(CU, pos, S, N_ITERS)
    adv = tl.load(ADV + seq, mask=row_ok, other=0.0)
    w = tl.load(WSEQ + seq, mask=row_ok, other=0.0)
    if HAS_TOKW:  # the caller's per-token weight (e.g. truncated IS) scales the token's whole loss
        w = w * tl.load(TOKW + rows, mask=row_ok, other=0.0)
    old = logp
    ref = logp
    if HAS_OLD:
        old = tl.load(OLD + rows, mask=row_ok, other=0.0)
    if HAS_REF:
        ref = tl.load(REF + rows, mask=row_ok, other=0.0)
    loss, dloss, clipped, dual, kl = grpo_token(logp, old, ref, adv, eps_low, eps_high, beta, clip_c, lr_clamp,
                                                stat_clamp, kl_clamp, kl_value, kl_grad, HAS_OLD, HAS_REF,
                                                DUAL_CLIP)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(COEF + rows, dloss * w, mask=row_ok)
    tl.store(LOSS_TOK + rows, loss * w, mask=row_ok)
    tl.store(CLIP_TOK + rows, tl.where(clipped, 1.0, 0.0), mask=row_ok)
    if DUAL_CLIP:
        tl.store(DUAL_TOK + rows, tl.where(dual, 1.0, 0.0), mask=row_ok)
    if HAS_REF:
        tl.store(KL_TOK + rows, kl, mask=row_ok)
    if WANT_ENT:
        tl.store(ENT_TOK + rows, ent, mask=row_ok)


class FusedLinearGrpoLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, advantages, loss_mask, cu_seqlens, old_logp, ref_logp,
                token_weights, settings):
        objective, compute_entropy = settings.objective, settings.compute_entropy
        n = hidden.shape[0]
        dev = hidden.device
        mask = loss_mask.reshape(-1).bool()
        pos = packing.loss_positions(mask)
        m = pos.numel()
        counts = packing.loss_token_counts(mask, cu_seqlens)
        w_seq = loss_types.sequence_weights(counts, settings.loss_type, settings.max_tokens)
        h, w = as_compute_pair(hidden.index_select(0, pos).contiguous(), weight.contiguous())
        tgt = targets.reshape(-1).index_select(0, pos).contiguous()
        old = packing.gather_per_token(old_logp, pos, n)
        ref = packing.gather_per_token(ref_logp, pos, n)
        tokw = packing.gather_per_token(None if token_weights is None else token_weights.detach(), pos, n)
        inv_t = 1.0 / settings.temperature

        f32 = dict(dtype=torch.float32, device=dev)
        lse, coef, loss_tok, clip_tok = (torch.empty(m, **f32) for _ in range(4))
        dual_tok = torch.empty(m, **f32) if objective.dual_clip else lse
        kl_tok = torch.empty(m, **f32) if ref is not None else lse
        ent_tok = torch.empty(m, **f32) if compute_entropy else lse
        if m > 0:
            (pm, ps, pzt, pez), n_splits = forward_partials(h, w, bias, tgt, inv_t, bool(compute_entropy))
            blk = 32 if interpreting() else 256
            _grpo_epilogue_kernel[(triton.cdiv(m, blk),)](
                pm, ps, pzt, pez, n_splits, pos, cu_seqlens.contiguous(),
                advantages.detach().reshape(-1).float().contiguous(), w_seq,
                old.contiguous() if old is not None else lse, ref.contiguous() if ref is not None else lse,
                tokw.contiguous() if tokw is not None else lse,
                lse, coef, loss_tok, clip_tok, dual_tok, kl_tok, ent_tok, m, counts.numel(),
                **objective.triton_args(), HAS_OLD=old is not None, HAS_REF=ref is not None,
                HAS_TOKW=tokw is not None, DUAL_CLIP=objective.dual_clip, WANT_ENT=bool(compute_entropy),
                N_ITERS=search_iters(counts.numel()), BLOCK=blk)
        denom = float(max(m, 1))
        stats = [clip_tok.sum() / denom]
        if objective.dual_clip:
            stats.append(dual_tok.sum() / denom)
        if ref is not None:
            stats.append(kl_tok.sum() / denom)
        if compute_entropy:
            stats.append(ent_tok.sum() / denom)
        ctx.save_for_backward(h, w, bias, tgt, lse, coef, pos)
        ctx.meta = (n, inv_t, hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(*stats)
        return (loss_tok.sum(), *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        h, w, bias, tgt, lse, coef, pos = ctx.saved_tensors
        n, inv_t, h_dtype, w_dtype = ctx.meta
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh, dw, db = linear_logprobs_backward(h, w, bias, tgt, lse, coef * grad_loss.float(), inv_t,
                                              need_h, need_w, need_b and bias is not None)
        dhidden = None
        if dh is not None:
            dhidden = torch.zeros(n, h.shape[1], dtype=h_dtype, device=h.device)
            dhidden.index_copy_(0, pos, dh.to(h_dtype))
        return (
            dhidden,
            None if dw is None else dw.to(w_dtype),
            None if db is None else db.to(bias.dtype),
        ) + (None,) * 8


def fused_linear_grpo_loss(hidden, weight, targets, advantages, loss_mask, cu_seqlens, old_logp=None,
                           ref_logp=None, bias=None, token_weights=None, *, settings: LossSettings):
    loss, *vals = FusedLinearGrpoLoss.apply(
        hidden, weight, bias, targets, advantages, loss_mask, cu_seqlens, old_logp, ref_logp, token_weights,
        settings)
    return loss, dict(zip(settings.stat_keys(ref_logp is not None), vals))
