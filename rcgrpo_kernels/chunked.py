"""PyTorch path chunked over tokens: the CPU implementation and the fallback.

Never builds the [N, V] logits. Each chunk of rows is projected into one
reusable fp32 [rows, V] buffer that is turned into log-probs (and, for the
loss, into d loss / d logits) in place, so peak memory is one chunk plus the
fp32 weight gradient, whatever N is.

Why no vocabulary chunking: with whole rows in a chunk the softmax is exact
in one pass, so the loss can produce its gradient in the same pass with no
recomputation of the logits (the projection is the cost that matters on a
CPU). Chunks of 256 rows ran fastest on the 2-core AVX2 target (measured
187 GFLOPS fwd+bwd at V=49k, vs 96 with 1,024 rows; flat at V=152k), and
the buffer (48 MiB at V=49k, 155 MiB at V=152k) stays small next to the
[V, H] fp32 weight gradient.

Shapes and dtypes are documented on the public functions in ``dispatch.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import advantage_estimators, loss_types, packing
from .loss_settings import LossSettings
from .objective import Objective, token_terms

CHUNK_ROWS = 256  # rows per chunk; see module docstring
CHUNK_BYTES = 256 << 20  # cap on the fp32 chunk buffer for very large vocabularies


def _rows_per_chunk(vocab: int, chunk_rows: Optional[int]) -> int:
    if chunk_rows is not None:
        return max(1, int(chunk_rows))
    return max(16, min(CHUNK_ROWS, CHUNK_BYTES // (4 * max(vocab, 1))))


def _project(h32, w32, b32, inv_t, out):
    """out[:] = (h32 @ w32.T + b32) / T, computed in fp32 into a reused buffer."""
    torch.mm(h32, w32.t(), out=out)
    if b32 is not None:
        out.add_(b32)
    if inv_t != 1.0:
        out.mul_(inv_t)
    return out


def _exp_normalise_(z, want_entropy):
    """Turn scaled logits z [c, V] into unnormalised probs e = exp(z - max) in
    place. Returns (lse [c], s [c], entropy [c] or None)."""
    m = z.amax(dim=1, keepdim=True)
    z.sub_(m).exp_()
    s = z.sum(dim=1)
    lse = m.squeeze(1) + torch.log(s)
    entropy = None
    if want_entropy:
        # H = log s - sum(e * log e) / s, since log e = z - max. xlogy keeps
        # 0 * log 0 at 0. Only paid for when asked.
        entropy = torch.log(s) - torch.special.xlogy(z, z).sum(dim=1) / s
    return lse, s, entropy


def _grad_logits_(e, s, targets, g, inv_t):
    """In place: e (unnormalised probs, rows sum to s) -> d/dz of sum_i g_i logp_i,
    i.e. g * (onehot(target) - p) / T, taken w.r.t. the unscaled logits."""
    rows = torch.arange(e.shape[0], device=e.device)
    e.mul_((-g / s).unsqueeze(1))
    e.index_put_((rows, targets), g, accumulate=True)
    if inv_t != 1.0:
        e.mul_(inv_t)
    return e


def _weights32(weight, bias):
    # One fp32 copy of a low-precision weight: CPU GEMMs in bf16/fp16 are
    # several times slower than in fp32 (no native bf16 on the target CPU).
    w32 = weight.float() if weight.dtype != torch.float32 else weight
    b32 = None if bias is None else bias.float()
    return w32.contiguous(), b32


# --------------------------------------------------------------------------
# token_logprobs: from logits
# --------------------------------------------------------------------------
class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_rows):
        n, v = logits.shape
        step = _rows_per_chunk(v, chunk_rows)
        inv_t = 1.0 / temperature
        t = targets.long()
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for a in range(0, n, step):
            b = min(a + step, n)
            z = logits[a:b].float() * inv_t  # fresh fp32 chunk, safe to edit
            zt = z.gather(1, t[a:b].unsqueeze(1)).squeeze(1)
            lse[a:b], _, _ = _exp_normalise_(z, False)
            logp[a:b] = zt - lse[a:b]
        ctx.save_for_backward(logits, t, lse)
        ctx.inv_t, ctx.step = inv_t, step
        return logp

    @staticmethod
    def backward(ctx, grad):
        logits, t, lse = ctx.saved_tensors
        grad = grad.float()
        out = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.step):
            b = min(a + ctx.step, logits.shape[0])
            p = (logits[a:b].float() * ctx.inv_t).sub_(lse[a:b].unsqueeze(1)).exp_()
            ones = torch.ones(b - a, dtype=torch.float32, device=p.device)
            out[a:b] = _grad_logits_(p, ones, t[a:b], grad[a:b], ctx.inv_t)
        return out, None, None, None


def token_logprobs(logits, targets, temperature=1.0, *, chunk_rows=None):
    return _TokenLogprobs.apply(logits, targets, float(temperature), chunk_rows)


# --------------------------------------------------------------------------
# fused_linear_logprobs: from hidden states and the lm_head weight
# --------------------------------------------------------------------------
class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, chunk_rows):
        n = hidden.shape[0]
        v = weight.shape[0]
        w32, b32 = _weights32(weight, bias)
        step = _rows_per_chunk(v, chunk_rows)
        inv_t = 1.0 / temperature
        t = targets.long()
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        buf = torch.empty(min(step, n), v, dtype=torch.float32, device=hidden.device)
        for a in range(0, n, step):
            b = min(a + step, n)
            z = _project(hidden[a:b].float(), w32, b32, inv_t, buf[: b - a])
            zt = z.gather(1, t[a:b].unsqueeze(1)).squeeze(1)
            lse[a:b], _, _ = _exp_normalise_(z, False)
            logp[a:b] = zt - lse[a:b]
        ctx.save_for_backward(hidden, weight, t, bias, lse)
        ctx.inv_t, ctx.step = inv_t, step
        return logp

    @staticmethod
    def backward(ctx, grad):
        # Recompute each chunk's logits from the saved logsumexp.
        hidden, weight, t, bias, lse = ctx.saved_tensors
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        n, v = hidden.shape[0], weight.shape[0]
        w32, b32 = _weights32(weight, bias)
        grad = grad.float()
        dh = torch.empty(n, hidden.shape[1], dtype=hidden.dtype, device=hidden.device) if need_h else None
        dw = torch.zeros(v, weight.shape[1], dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(v, dtype=torch.float32, device=weight.device) if (need_b and bias is not None) else None
        buf = torch.empty(min(ctx.step, n), v, dtype=torch.float32, device=hidden.device)
        for a in range(0, n, ctx.step):
            b = min(a + ctx.step, n)
            h32 = hidden[a:b].float()
            z = _project(h32, w32, b32, ctx.inv_t, buf[: b - a])
            z.sub_(lse[a:b].unsqueeze(1)).exp_()
            ones = torch.ones(b - a, dtype=torch.float32, device=z.device)
            dz = _grad_logits_(z, ones, t[a:b], grad[a:b], ctx.inv_t)
            if dh is not None:
                dh[a:b] = dz @ w32
            if dw is not None:
                dw.addmm_(dz.t(), h32)
            if db is not None:
                db.add_(dz.sum(0))
        return (
            dh,
            None if dw is None else dw.to(weight.dtype),
            None,
            None if db is None else db.to(bias.dtype),
            None,
            None,
        )


def fused_linear_logprobs(hidden, weight, targets, temperature=1.0, bias=None, *, chunk_rows=None):
    return _FusedLinearLogprobs.apply(hidden, weight, targets, bias, float(temperature), chunk_rows)


# --------------------------------------------------------------------------
# group_advantages
# --------------------------------------------------------------------------
def group_advantages(rewards, seq_group, eps=1e-6, estimator="grpo"):
    est = advantage_estimators.get_advantage_estimator(estimator)
    r = rewards.float().reshape(-1)
    num = r.numel()
    if num == 0:
        return r.clone()
    _, label = torch.unique(seq_group.reshape(-1), return_inverse=True)
    num_groups = int(label.max()) + 1
    pos = torch.arange(num, device=r.device)
    first = torch.full((num_groups,), num, device=r.device, dtype=torch.long)
    first = first.scatter_reduce(0, label, pos, reduce="amin")
    # Shift by the group's first reward: a constant group then has a mean
    # exactly equal to its value, so its advantage is exactly 0.
    pivot = r.detach()[first][label]
    count = torch.zeros(num_groups, device=r.device).index_add_(0, label, torch.ones_like(r))
    shifted_sum = torch.zeros(num_groups, device=r.device).index_add(0, label, r - pivot)
    adv = r - (pivot + (shifted_sum / count)[label])
    if est.scale_by_std:
        dof = (count - est.ddof).clamp(min=1.0)  # a group of one has dev == 0 whatever it divides by
        var = torch.zeros(num_groups, device=r.device).index_add(0, label, adv * adv) / dof
        pos_var = var > 0
        # double-where: sqrt'(0) is infinite, but constant groups have dev == 0
        std = torch.where(pos_var, torch.sqrt(torch.where(pos_var, var, torch.ones_like(var))),
                          torch.zeros_like(var))
        adv = adv / (std[label] + eps)
    if est.leave_one_out:
        adv = adv * (count / (count - 1.0).clamp(min=1.0))[label]
    return adv


# --------------------------------------------------------------------------
# The clipped objective (rcgrpo_kernels/objective.py holds its per-token terms)
# --------------------------------------------------------------------------
def _per_token_inputs(loss_mask, cu_seqlens, advantages, loss_type, max_tokens, token_weights, n):
    """Loss positions, each one's advantage and its weight in the reduced loss:
    the loss type's per-sequence weight times the caller's per-token weight."""
    pos = packing.loss_positions(loss_mask)
    seq = packing.sequence_ids(pos, cu_seqlens)
    counts = packing.loss_token_counts(loss_mask.reshape(-1).bool(), cu_seqlens)
    w = loss_types.sequence_weights(counts, loss_type, max_tokens)[seq]
    tw = packing.gather_per_token(token_weights, pos, n)
    if tw is not None:
        w = w * tw.detach()
    return pos, advantages.detach().float()[seq], w


def _stats(clipped_count, dual_count, kl_sum, ent_sum, num_tokens):
    denom = float(max(num_tokens, 1))
    stats = {"clip_frac": clipped_count / denom}
    if dual_count is not None:
        stats["clip_frac_lower"] = dual_count / denom
    if kl_sum is not None:
        stats["kl"] = kl_sum / denom
    if ent_sum is not None:
        stats["entropy"] = ent_sum / denom
    return stats


class _GrpoLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, objective, loss_type, max_tokens,
                token_weights):
        n = logp.numel()
        pos, adv, w = _per_token_inputs(loss_mask, cu_seqlens, advantages, loss_type, max_tokens,
                                        token_weights, n)
        lp = logp.reshape(-1).index_select(0, pos).float()
        old = packing.gather_per_token(old_logp, pos, n)
        ref = packing.gather_per_token(ref_logp, pos, n)
        loss_tok, dloss, clipped, dual, kl = token_terms(lp, old, ref, adv, objective)
        loss = (w * loss_tok).sum()
        ctx.save_for_backward(pos, w * dloss)
        ctx.n, ctx.shape, ctx.dtype = n, logp.shape, logp.dtype
        stats = _stats(clipped.sum().float(), dual.sum().float() if objective.dual_clip else None,
                       None if kl is None else kl.sum(), None, pos.numel())
        ctx.mark_non_differentiable(*stats.values())
        return (loss, *stats.values())

    @staticmethod
    def backward(ctx, grad_loss, *_):
        pos, g = ctx.saved_tensors
        dlogp = torch.zeros(ctx.n, dtype=torch.float32, device=g.device)
        dlogp.index_copy_(0, pos, g * grad_loss.float())
        return (dlogp.reshape(ctx.shape).to(ctx.dtype),) + (None,) * 9


def grpo_loss(logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, eps_low=0.2, eps_high=0.2,
              beta=0.0, loss_type="grpo", *, max_tokens=None, token_weights=None, clip_ratio_c=None,
              kl_estimator="k3", log_ratio_clamp=None, kl_clamp=None):
    loss_types.get_loss_type(loss_type)
    objective = Objective(eps_low, eps_high, beta, clip_ratio_c, kl_estimator, log_ratio_clamp, kl_clamp)
    loss, *vals = _GrpoLoss.apply(logp, old_logp, ref_logp, advantages, loss_mask, cu_seqlens, objective,
                                  loss_type, max_tokens, token_weights)
    return loss, dict(zip(objective.stat_keys(ref_logp is not None), vals))


# --------------------------------------------------------------------------
# fused_linear_grpo_loss: projection + log-probs + loss + gradient in one pass
# --------------------------------------------------------------------------
class _FusedLinearGrpoLoss(torch.autograd.Function):
    """Forward does the backward work too (like a flash-style fused loss):
    the loss is a scalar, so d loss / d logits of each chunk is known up to
    the upstream scalar while the chunk's probabilities are still in the
    buffer. backward() only rescales. Skipped when no gradient is needed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, advantages, loss_mask, cu_seqlens, old_logp, ref_logp,
                token_weights, settings, need_grad, chunk_rows):
        n, hdim = hidden.shape
        v = weight.shape[0]
        dev = hidden.device
        objective, compute_entropy = settings.objective, settings.compute_entropy
        pos, adv, w = _per_token_inputs(loss_mask, cu_seqlens, advantages, settings.loss_type, settings.max_tokens,
                                        token_weights, n)
        m = pos.numel()
        old = packing.gather_per_token(old_logp, pos, n)
        ref = packing.gather_per_token(ref_logp, pos, n)
        tgt = targets.reshape(-1).long().index_select(0, pos)
        w32, b32 = _weights32(weight, bias)
        inv_t = 1.0 / settings.temperature
        step = _rows_per_chunk(v, chunk_rows)

        want_h = need_grad and ctx.needs_input_grad[0]
        want_w = need_grad and ctx.needs_input_grad[1]
        want_b = need_grad and bias is not None and ctx.needs_input_grad[2]
        dh = torch.empty(m, hdim, dtype=torch.float32, device=dev) if want_h else None
        dw = torch.zeros(v, hdim, dtype=torch.float32, device=dev) if want_w else None
        db = torch.zeros(v, dtype=torch.float32, device=dev) if want_b else None

        loss = torch.zeros((), dtype=torch.float32, device=dev)
        clipped_count = torch.zeros((), dtype=torch.float32, device=dev)
        dual_count = torch.zeros((), dtype=torch.float32, device=dev) if objective.dual_clip else None
        kl_sum = None if ref is None else torch.zeros((), dtype=torch.float32, device=dev)
        ent_sum = torch.zeros((), dtype=torch.float32, device=dev) if compute_entropy else None
        buf = torch.empty(max(min(step, m), 1), v, dtype=torch.float32, device=dev)
        for a in range(0, m, step):
            b = min(a + step, m)
            h32 = hidden.index_select(0, pos[a:b]).float()
            z = _project(h32, w32, b32, inv_t, buf[: b - a])
            zt = z.gather(1, tgt[a:b].unsqueeze(1)).squeeze(1)
            lse, s, ent = _exp_normalise_(z, compute_entropy)
            logp = zt - lse
            loss_tok, dloss, clipped, dual, kl = token_terms(
                logp, None if old is None else old[a:b], None if ref is None else ref[a:b], adv[a:b], objective)
            loss += (w[a:b] * loss_tok).sum()
            clipped_count += clipped.sum()
            if dual_count is not None:
                dual_count += dual.sum()
            if kl is not None:
                kl_sum += kl.sum()
            if ent is not None:
                ent_sum += ent.sum()
            if want_h or want_w or want_b:
                dz = _grad_logits_(z, s, tgt[a:b], w[a:b] * dloss, inv_t)
                if want_h:
                    torch.mm(dz, w32, out=dh[a:b])
                if want_w:
                    dw.addmm_(dz.t(), h32)
                if want_b:
                    db.add_(dz.sum(0))
        del buf
        ctx.save_for_backward(pos, dh, dw, db)
        ctx.meta = (n, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        stats = _stats(clipped_count, dual_count, kl_sum, ent_sum, m)
        ctx.mark_non_differentiable(*stats.values())
        return (loss, *stats.values())

    @staticmethod
    def backward(ctx, grad_loss, *_):
        pos, dh, dw, db = ctx.saved_tensors
        n, h_dtype, w_dtype, b_dtype = ctx.meta
        go = grad_loss.float()
        # The usual upstream gradient is exactly 1: then hand the saved fp32
        # buffers over as they are instead of copying a [V, H] weight gradient.
        unit = bool(go == 1.0)

        def scaled(x, dtype):
            return x.to(dtype) if unit else (x * go).to(dtype)

        dhidden = dweight = dbias = None
        if dh is not None:
            dhidden = torch.zeros(n, dh.shape[1], dtype=h_dtype, device=dh.device)
            dhidden.index_copy_(0, pos, scaled(dh, h_dtype))
        if dw is not None:
            dweight = scaled(dw, w_dtype)
        if db is not None:
            dbias = scaled(db, b_dtype)
        return (dhidden, dweight, dbias) + (None,) * 10


def fused_linear_grpo_loss(hidden, weight, targets, advantages, loss_mask, cu_seqlens, old_logp=None,
                           ref_logp=None, bias=None, token_weights=None, *, settings: LossSettings,
                           chunk_rows=None):
    """``chunk_rows``: rows per chunk (None: ``_rows_per_chunk``'s choice)."""
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss, *vals = _FusedLinearGrpoLoss.apply(
        hidden, weight, bias, targets, advantages, loss_mask, cu_seqlens, old_logp, ref_logp, token_weights,
        settings, need_grad, chunk_rows)
    return loss, dict(zip(settings.stat_keys(ref_logp is not None), vals))
