"""Token log-probs from hidden states and the lm_head weight, fused.

Forward: each program owns a block of BLOCK_M tokens and one slice of the
vocabulary, which it sweeps in BLOCK_V tiles; each logits tile is a K-loop of
``tl.dot`` kept in registers, folded into an online logsumexp (and target
gather, optional entropy) and dropped. A second tiny launch merges the
per-slice partials. The [N, V] logits are never written; only lse [N] is
saved.

Backward: the logits are recomputed tile by tile from the saved lse and
turned into d/dlogits, written for one chunk of tokens at a time into a
bounded [chunk, V] buffer, and two cuBLAS GEMMs give dhidden and dweight.
Why not accumulate dhidden / dweight inside the kernel like flash-attention:
a program would need a [BLOCK_M, H] (or [BLOCK_V, H]) fp32 accumulator, and
H = 896..8192 does not fit in registers; splitting H would recompute the
logits H / BLOCK times, and dweight would need atomics over [V, H]. The
chunked buffer costs bounded memory and keeps the GEMMs on tensor cores.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import dot_precision, interpreting, upcast_for_dot

DZ_CHUNK_BYTES = 1 << 30  # d/dlogits buffer per backward chunk (GPU)


@triton.jit
def lse_partial(H, stride_h, W, stride_w, BIAS, targets, rows, row_ok, v_lo, v_hi, HDIM, inv_temp,
                HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_K: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online logsumexp of z = (h W^T + b) / T over the vocab range [v_lo, v_hi)
    for a block of rows, each logits tile a K-loop of tl.dot kept in registers.

    Returns fp32 [BLOCK_M] partials (m, s, zt, ez): running max, sum of
    exp(z - m), the target's z if it lies in the range (else 0) and, only if
    WANT_ENT, sum of exp(z - m) * z (for the entropy lse - sum(p z))."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    zt = tl.zeros((BLOCK_M,), tl.float32)
    ez = tl.zeros((BLOCK_M,), tl.float32)
    rows64 = rows.to(tl.int64)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
        for k0 in range(0, HDIM, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HDIM
            h = tl.load(H + rows64[:, None] * stride_h + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + cols64[None, :] * stride_w + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, w, acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        s = s * alpha + tl.sum(e, 1)
        if WANT_ENT:
            ez = ez * alpha + tl.sum(e * tl.where(col_ok[None, :], z, 0.0), 1)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == targets[:, None], z, 0.0), 1)
    return m, s, zt, ez


@triton.jit
def _partials_kernel(H, stride_h, W, stride_w, BIAS, TARGETS, PM, PS, PZT, PEZ, M, V, HDIM, n_splits, split_len,
                     inv_temp, HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, PREC: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Flattened 1-D grid over (token block, vocab split), token block major.
    Splitting the vocabulary keeps every SM busy when there are few loss
    tokens (4k tokens are only 64 blocks of 64); the splits are merged by
    ``combine_partials``. The [N, V] logits are never written."""
    pid = tl.program_id(0)
    pid_m = pid // n_splits
    pid_s = pid % n_splits
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    v_lo = pid_s * split_len
    v_hi = tl.minimum(v_lo + split_len, V)
    tgt = tl.load(TARGETS + rows, mask=row_ok, other=0).to(tl.int32)
    m, s, zt, ez = lse_partial(H, stride_h, W, stride_w, BIAS, tgt, rows, row_ok, v_lo, v_hi, HDIM, inv_temp,
                               HAS_BIAS, WANT_ENT, BLOCK_M, BLOCK_V, BLOCK_K, PREC, UPCAST)
    off = pid_s * M + rows
    tl.store(PM + off, m, mask=row_ok)
    tl.store(PS + off, s, mask=row_ok)
    tl.store(PZT + off, zt, mask=row_ok)
    if WANT_ENT:
        tl.store(PEZ + off, ez, mask=row_ok)


@triton.jit
def combine_partials(PM, PS, PZT, PEZ, rows, row_ok, M, n_splits, WANT_ENT: tl.constexpr):
    """Merge the per-split partials of ``rows``: (lse, target logit, entropy)."""
    mx = tl.load(PM + rows, mask=row_ok, other=0.0)
    for k in range(1, n_splits):
        mx = tl.maximum(mx, tl.load(PM + k * M + rows, mask=row_ok, other=0.0))
    s = tl.zeros_like(mx)
    zt = tl.zeros_like(mx)
    ez = tl.zeros_like(mx)
    for k in range(0, n_splits):
        scale = tl.exp(tl.load(PM + k * M + rows, mask=row_ok, other=0.0) - mx)  # 0 for an empty split
        s += tl.load(PS + k * M + rows, mask=row_ok, other=0.0) * scale
        zt += tl.load(PZT + k * M + rows, mask=row_ok, other=0.0)
        if WANT_ENT:
            ez += tl.load(PEZ + k * M + rows, mask=row_ok, other=0.0) * scale
    s = tl.where(row_ok, s, 1.0)
    lse = mx + tl.log(s)
    ent = tl.zeros_like(mx)
    if WANT_ENT:
        ent = lse - ez / s
    return lse, zt, ent


@triton.jit
def _combine_logprob_kernel(PM, PS, PZT, LOGP, LSE, M, n_splits, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < M
    lse, zt, _ = combine_partials(PM, PS, PZT, PM, rows, row_ok, M, n_splits, False)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(LOGP + rows, zt - lse, mask=row_ok)


@triton.jit
def _dlogits_kernel(H, stride_h, W, stride_w, BIAS, TARGETS, LSE, COEF, DZ, stride_dz, M, V, HDIM,
                    inv_temp, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """DZ[r, c] = COEF[r] * (onehot(target)[c] - p[r, c]) / T, recomputing the
    logits tile from the saved lse. Flattened 1-D grid: token block major, so
    consecutive programs reuse one hidden tile while streaming the weight."""
    n_vblocks = tl.cdiv(V, BLOCK_V)
    pid = tl.program_id(0)
    pid_m = pid // n_vblocks
    pid_v = pid % n_vblocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < M
    col_ok = cols < V
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    for k0 in range(0, HDIM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < HDIM
        h = tl.load(H + rows64[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols64[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    coef = tl.load(COEF + rows, mask=row_ok, other=0.0)
    tgt = tl.load(TARGETS + rows, mask=row_ok, other=-1).to(tl.int32)
    p = tl.exp(acc * inv_temp - lse[:, None])
    onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    dz = (onehot - p) * (coef * inv_temp)[:, None]
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(DZ + rows64[:, None] * stride_dz + cols64[None, :], dz.to(DZ.dtype.element_ty), mask=ok)


# Interpreter runs use small fixed tiles (tl.dot needs >= 16); on a GPU the
# tile shape is autotuned once per (V, HDIM, dtype).
INTERP_BLOCKS = dict(BLOCK_M=16, BLOCK_V=32, BLOCK_K=16)
_GPU_CONFIGS = [
    triton.Config(dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=64), num_warps=8, num_stages=3),
    triton.Config(dict(BLOCK_M=128, BLOCK_V=128, BLOCK_K=64), num_warps=8, num_stages=3),
    triton.Config(dict(BLOCK_M=128, BLOCK_V=64, BLOCK_K=64), num_warps=4, num_stages=4),
    triton.Config(dict(BLOCK_M=64, BLOCK_V=256, BLOCK_K=32), num_warps=8, num_stages=3),
]


def tuned(kernel):
    """The kernel itself under the interpreter, else an autotuned wrapper.
    Every tuned kernel only writes its outputs (no atomics, no accumulation),
    so the autotuner's repeated launches are harmless. KERNELS_AUTOTUNE=0
    pins the first config: correctness tests on many tiny shapes then compile
    one variant per shape instead of four."""
    if interpreting():
        return kernel
    configs = _GPU_CONFIGS if os.environ.get("KERNELS_AUTOTUNE", "1") != "0" else _GPU_CONFIGS[:1]
    return triton.autotune(configs=configs, key=["V", "HDIM", "PREC", "HAS_BIAS", "UPCAST"])(kernel)


def launch(kernel, grid_of_blocks, *args, **kwargs):
    """Launch ``kernel`` (from ``tuned``) with a grid computed from its tile sizes."""
    if interpreting():
        kernel[grid_of_blocks(INTERP_BLOCKS)](*args, **kwargs, **INTERP_BLOCKS)
    else:
        kernel[grid_of_blocks](*args, **kwargs)


_partials = tuned(_partials_kernel)
_dlogits = tuned(_dlogits_kernel)


def as_compute_pair(hidden, weight):
    """tl.dot needs one dtype; mixed inputs are promoted to fp32."""
    if hidden.dtype != weight.dtype:
        return hidden.float(), weight.float()
    return hidden, weight


def vocab_splits(m: int, v: int, device: torch.device) -> tuple[int, int]:
    """(number of vocab splits, split length) so that the grid covers the GPU:
    about four programs per SM for the smallest token tile. Split lengths are
    multiples of every BLOCK_V in use, so only the last split is ragged.
    The interpreter uses up to 3 splits, so tests exercise the merge."""
    if interpreting():
        gran, splits = INTERP_BLOCKS["BLOCK_V"], 3
    else:
        gran = max(c.kwargs["BLOCK_V"] for c in _GPU_CONFIGS)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        m_blocks = triton.cdiv(m, min(c.kwargs["BLOCK_M"] for c in _GPU_CONFIGS))
        splits = triton.cdiv(4 * sms, max(m_blocks, 1))
    splits = max(1, min(splits, triton.cdiv(v, gran)))
    split_len = triton.cdiv(triton.cdiv(v, splits), gran) * gran
    return triton.cdiv(v, split_len), split_len


def forward_partials(h, w, bias, targets, inv_temp, want_entropy):
    """Launch the split-vocabulary sweep: h [M, H], w [V, H] (one dtype).
    Returns (partials (pm, ps, pzt, pez) each [splits, M] fp32, n_splits)."""
    m, hdim = h.shape
    v = w.shape[0]
    n_splits, split_len = vocab_splits(m, v, h.device)
    part = torch.empty(4 if want_entropy else 3, n_splits, m, dtype=torch.float32, device=h.device)
    pm, ps, pzt = part[0], part[1], part[2]
    pez = part[3] if want_entropy else pm
    launch(_partials, lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * n_splits,),
           h, h.stride(0), w, w.stride(0), bias if bias is not None else h, targets, pm, ps, pzt, pez,
           m, v, hdim, n_splits, split_len, inv_temp, HAS_BIAS=bias is not None, WANT_ENT=want_entropy,
           PREC=dot_precision(h.dtype), UPCAST=upcast_for_dot(h.dtype))
    return (pm, ps, pzt, pez), n_splits


def linear_logprobs_forward(h, w, bias, targets, inv_temp):
    """h [M, H], w [V, H] (same dtype, row-major) -> (logp [M], lse [M]) fp32."""
    m = h.shape[0]
    logp = torch.empty(m, dtype=torch.float32, device=h.device)
    lse = torch.empty(m, dtype=torch.float32, device=h.device)
    if m > 0:
        (pm, ps, pzt, _), n_splits = forward_partials(h, w, bias, targets, inv_temp, False)
        blk = 32 if interpreting() else 256
        _combine_logprob_kernel[(triton.cdiv(m, blk),)](pm, ps, pzt, logp, lse, m, n_splits, BLOCK=blk)
    return logp, lse


def linear_logprobs_backward(h, w, bias, targets, lse, coef, inv_temp, need_h, need_w, need_b):
    """Gradients of sum_r coef[r] * logp[r] w.r.t. h [M, H], w [V, H], bias [V].

    Returns (dh in h.dtype or None, dw fp32 or None, db fp32 or None)."""
    m, hdim = h.shape
    v = w.shape[0]
    dh = torch.empty_like(h) if need_h else None
    dw = torch.zeros(v, hdim, dtype=torch.float32, device=h.device) if need_w else None
    db = torch.zeros(v, dtype=torch.float32, device=h.device) if need_b else None
    if m == 0 or not (need_h or need_w or need_b):
        return dh, dw, db
    rows = max(128, DZ_CHUNK_BYTES // (v * h.element_size()))
    rows = min(m, rows)
    dz_buf = torch.empty(rows, v, dtype=h.dtype, device=h.device)
    prec = dot_precision(h.dtype)
    for a in range(0, m, rows):
        b = min(a + rows, m)
        dz = dz_buf[: b - a]
        hc = h[a:b]
        n = b - a
        launch(_dlogits, lambda meta: (triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(v, meta["BLOCK_V"]),),
               hc, hc.stride(0), w, w.stride(0), bias if bias is not None else hc, targets[a:b], lse[a:b],
               coef[a:b], dz, dz.stride(0), n, v, hdim, inv_temp, HAS_BIAS=bias is not None, PREC=prec,
               UPCAST=upcast_for_dot(h.dtype))
        if need_h:
            torch.mm(dz, w, out=dh[a:b])
        if need_w:
            if dz.dtype == torch.float32:
                dw.addmm_(dz.t(), hc)
            else:  # low-precision GEMM (fp32 accumulate), summed across chunks in fp32
                dw += torch.mm(dz.t(), hc).float()
        if need_b:
            db += dz.float().sum(0)
    return dh, dw, db


class FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature):
        h, w = as_compute_pair(hidden.contiguous(), weight.contiguous())
        t = targets.reshape(-1).contiguous()
        inv_t = 1.0 / temperature
        logp, lse = linear_logprobs_forward(h, w, bias, t, inv_t)
        ctx.save_for_backward(h, w, t, bias, lse)
        ctx.inv_t = inv_t
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return logp

    @staticmethod
    def backward(ctx, grad):
        h, w, t, bias, lse = ctx.saved_tensors
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        dh, dw, db = linear_logprobs_backward(h, w, bias, t, lse, grad.float().contiguous(), ctx.inv_t,
                                              need_h, need_w, need_b and bias is not None)
        h_dtype, w_dtype = ctx.dtypes
        return (
            None if dh is None else dh.to(h_dtype),
            None if dw is None else dw.to(w_dtype),
            None,
            None if db is None else db.to(bias.dtype),
            None,
        )


def fused_linear_logprobs(hidden, weight, targets, temperature=1.0, bias=None):
    return FusedLinearLogprobs.apply(hidden, weight, targets, bias, float(temperature))
