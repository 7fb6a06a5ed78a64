"""Token log-probs from hidden states and the lm_head weight, fused.

Forward: each program owns a block of BLOCK_M tokens and one slice of the
vocabulary, which it sweeps in BLOCK_V tiles; each logits tile is a K-loop of
``tl.dot`` kept in registers, folded into an online logsumexp (and target
gather, optional entropy) and dropped. A second tiny launch merges the
per-slice partials. The [N, V] logits are never written; only lse [N] is
saved.

Backward: the logits are recomputed tile by tile from the saved lse and
turned into d/dlogits, written for one chunk of tokens at a time into a
[chunk, V] buffer sized from free memory (usually one chunk), and two cuBLAS
GEMMs give dhidden and dweight (fp32 accumulation and fp32 output).
Why not accumulate dhidden / dweight inside the kernel like flash-attention:
a program would need a [BLOCK_M, H] (or [BLOCK_V, H]) fp32 accumulator, and
H = 896..8192 does not fit in registers; splitting H would recompute the
logits H / BLOCK times, and dweight would need atomics over [V, H]. The
chunked buffer costs bounded memory and keeps the GEMMs on tensor cores.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .common import Tuner, dot_precision, interpreting, size_bucket, upcast_for_dot


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
        # A tile whose logits are all -inf so far (an lm_head bias of -inf)
        # would give -inf - -inf = NaN: shift by 0 there instead.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        e = tl.exp(z - shift[:, None])
        s = s * alpha + tl.sum(e, 1)
        if WANT_ENT:
            ez = ez * alpha + tl.sum(e * tl.where(e > 0.0, z, 0.0), 1)  # 0 log 0 = 0 (masked or -inf logits)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == targets[:, None], z, 0.0), 1)
    return m, s, zt, ez


@triton.jit
def _partials_kernel(H, stride_h, W, stride_w, BIAS, TARGETS, PM, PS, PZT, PEZ, M, V, HDIM, n_splits, split_len,
                     inv_temp, HAS_BIAS: tl.constexpr, WANT_ENT: tl.constexpr, PREC: tl.constexpr,
                     UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Flattened 1-D grid over (token block, vocab split), token block major.
    Splitting the vocabulary keeps every SM busy when there are few loss
    tokens (4k tokens are only 32 blocks of 128); the split count is chosen
    per tile config (``vocab_splits``) and the splits are merged by
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
def grouped_tile(pid, n_m, n_v, GROUP_M):
    """(token block, vocab block) of program ``pid`` for the d/dlogits grid.

    Programs walk the vocabulary inside a group of GROUP_M token blocks:
    consecutive programs take the group's token blocks for one vocab tile,
    then move to the next tile. The weight (V x H, 272 MB at V = 151,936,
    H = 896 in bf16, far above a 50-60 MB L2) then streams from HBM once per
    group instead of once per token block, while the group's hidden rows
    (sized on the host to a share of L2) stay cached."""
    per_group = GROUP_M * n_v
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % size, local // size


@triton.jit
def _dlogits_kernel(H, stride_h, W, stride_w, BIAS, TARGETS, LSE, COEF, DZ, stride_dz, M, V, HDIM,
                    inv_temp, GROUP_M, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """DZ[r, c] = COEF[r] * (onehot(target)[c] - p[r, c]) / T, recomputing the
    logits tile from the saved lse. Flattened 1-D grid in ``grouped_tile`` order."""
    pid_m, pid_v = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(V, BLOCK_V), GROUP_M)
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


# Tile configs timed per key on a GPU, per kind. Each list holds only tiles
# that compile without register spills for sm_90 and sm_80 (checked by
# tests/kernels/test_kernels_compile.py): the entropy sum keeps one more
# [BLOCK_M, BLOCK_V] tile live, and tf32x3 splits every fp32 operand in two.
_C = triton.Config
CONFIGS = {
    "bf16": [  # bf16 and fp16 tiles
        _C(dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=64), num_warps=8, num_stages=3),
        _C(dict(BLOCK_M=128, BLOCK_V=128, BLOCK_K=64), num_warps=8, num_stages=3),
        _C(dict(BLOCK_M=128, BLOCK_V=64, BLOCK_K=64), num_warps=4, num_stages=4),
        _C(dict(BLOCK_M=64, BLOCK_V=256, BLOCK_K=32), num_warps=8, num_stages=3),
    ],
    "bf16_entropy": [
        _C(dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=64), num_warps=8, num_stages=3),
        _C(dict(BLOCK_M=128, BLOCK_V=64, BLOCK_K=64), num_warps=8, num_stages=4),
    ],
    "fp32": [
        _C(dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=32), num_warps=8, num_stages=3),
        _C(dict(BLOCK_M=128, BLOCK_V=64, BLOCK_K=32), num_warps=8, num_stages=3),
        _C(dict(BLOCK_M=64, BLOCK_V=64, BLOCK_K=32), num_warps=4, num_stages=3),
    ],
}
GPU_CONFIGS = [c for cfgs in CONFIGS.values() for c in cfgs]
# The interpreter runs small tiles (tl.dot needs >= 16) unless a config is forced.
INTERP_CONFIG = _C(dict(BLOCK_M=16, BLOCK_V=32, BLOCK_K=16), num_warps=4, num_stages=1)
partials_tuner = Tuner(CONFIGS, INTERP_CONFIG)
dlogits_tuner = Tuner({k: v for k, v in CONFIGS.items() if k != "bf16_entropy"}, INTERP_CONFIG)


def tile_kind(dtype: torch.dtype, want_entropy: bool = False) -> str:
    """Which config list serves tiles of ``dtype``."""
    if dtype == torch.float32:
        return "fp32"
    return "bf16_entropy" if want_entropy else "bf16"


def config_for(dtype: torch.dtype, want_entropy: bool, forced):
    """The forward config a launch of this kind runs with under ``forced_config(forced)``
    (the interpreter's when ``forced`` pins nothing for it)."""
    return partials_tuner.forced_choice(tile_kind(dtype, want_entropy), forced) or INTERP_CONFIG


# The interpreter pretends to have 2 SMs, so that small test problems already
# take several vocabulary splits of several tiles each.
INTERP_SMS = 2
# Share of L2 for the hidden rows of one d/dlogits token group (see grouped_tile).
L2_SHARE_FOR_HIDDEN = 0.4
# Interpreter: pretend L2 holds 64 hidden rows of 64 fp32 values (several
# ragged groups in the tests).
INTERP_L2_BYTES = 64 * 64 * 4 / L2_SHARE_FOR_HIDDEN


@contextlib.contextmanager
def forced_config(cfg):
    """Run the fused-linear launches inside the block with ``cfg``: a Config
    (for the kinds that list it; INTERP_CONFIG for all) or an index i (each
    kind's i-th config). For tests and gpu-check."""
    saved = partials_tuner.forced, dlogits_tuner.forced
    partials_tuner.forced = dlogits_tuner.forced = cfg
    try:
        yield
    finally:
        partials_tuner.forced, dlogits_tuner.forced = saved


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; off a GPU (interpreter, or
    ahead-of-time tracing of launches) a planning value."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERP_SMS if interpreting() else 132  # an H200


def as_compute_pair(hidden, weight):
    """One dtype for ``tl.dot``. When one operand is fp32 and the other bf16
    or fp16 (fp32 master lm_head weight with autocast hidden states), the fp32
    one is rounded down: the tile products stay on the bf16/fp16 tensor cores
    and the hidden states are never copied up to fp32. Two different
    low-precision dtypes compute in the hidden states' dtype."""
    if hidden.dtype == weight.dtype:
        return hidden, weight
    if hidden.dtype == torch.float32:
        return hidden.to(weight.dtype), weight
    return hidden, weight.to(hidden.dtype)


@functools.lru_cache(maxsize=4096)
def vocab_splits(m: int, v: int, block_m: int, block_v: int, sms: int) -> tuple[int, int]:
    """(number of vocab splits, split length) for the forward sweep of one
    tile config: the split count whose program count fills whole waves best.

    A wave is 2 * sms programs, so whole waves stay whole whether one or two
    programs fit on an SM. Efficiency counts work in vocab tiles: the grid of
    n_m token blocks x s splits of t tiles runs in ceil(programs / wave)
    waves of t tiles, while the useful work is n_m x (all tiles); a ragged
    last split and a part-filled last wave both cost. Among near-equal
    choices the fewest splits win (fewer partials to merge). Split lengths
    are whole tiles, so only the last split is ragged."""
    n_m = triton.cdiv(m, block_m)
    tiles = triton.cdiv(v, block_v)
    wave = 2 * sms
    scored = []
    for s in range(1, tiles + 1):
        t = triton.cdiv(tiles, s)
        splits = triton.cdiv(tiles, t)
        if scored and splits == scored[-1][1]:
            continue
        waves = triton.cdiv(n_m * splits, wave)
        scored.append((n_m * tiles / (waves * wave * t), splits, t))
    best = max(e for e, _, _ in scored)
    splits, t = min((sp, t) for e, sp, t in scored if e >= best - 1e-3)
    return splits, t * block_v


def forward_partials(h, w, bias, targets, inv_temp, want_entropy):
    """Launch the split-vocabulary sweep: h [M, H], w [V, H] (one dtype).
    Returns (partials (pm, ps, pzt, pez) each [splits, M] fp32, n_splits)."""
    m, hdim = h.shape
    v = w.shape[0]
    sms = sm_count(h.device)

    def launch(cfg):
        bm = cfg.kwargs["BLOCK_M"]
        n_splits, split_len = vocab_splits(m, v, bm, cfg.kwargs["BLOCK_V"], sms)
        part = torch.empty(4 if want_entropy else 3, n_splits, m, dtype=torch.float32, device=h.device)
        pm, ps, pzt = part[0], part[1], part[2]
        pez = part[3] if want_entropy else pm
        _partials_kernel[(triton.cdiv(m, bm) * n_splits,)](
            h, h.stride(0), w, w.stride(0), bias if bias is not None else h, targets, pm, ps, pzt, pez,
            m, v, hdim, n_splits, split_len, inv_temp, HAS_BIAS=bias is not None, WANT_ENT=want_entropy,
            PREC=dot_precision(h.dtype), UPCAST=upcast_for_dot(h.dtype), **cfg.all_kwargs())
        return (pm, ps, pzt, pez), n_splits

    key = (v, hdim, size_bucket(m), h.dtype, bias is not None, bool(want_entropy))
    return partials_tuner.run(tile_kind(h.dtype, want_entropy), key, launch, h.device)


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


def dz_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """d/dlogits storage dtype. fp16 would flush the typical entries to zero:
    coef * p / T is ~1e-9 at V = 151,936 with per-token loss weights ~1e-4,
    below fp16's smallest subnormal (6e-8). fp16 inputs therefore keep dz in
    fp32 (bf16 has the range but, with 8 bits, costs fp16 inputs accuracy
    they had), and their two backward GEMMs run in fp32; fp16 training is
    rare enough that its speed matters less than its gradients. fp32 and
    bf16 inputs keep their own dtype."""
    return torch.float32 if dtype == torch.float16 else dtype


def dz_chunk_rows(m: int, v: int, dz_bytes: int, device: torch.device, reserve_bytes: int = 0) -> int:
    """Rows of the [rows, V] d/dlogits buffer per backward chunk.

    On a GPU, half of the memory that is free (to the driver plus what the
    caching allocator holds unused), less ``reserve_bytes`` for the other
    outputs of the backward; one chunk covers all rows whenever that fits,
    which takes the single-chunk fast path. The interpreter uses 64 MiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = max(free - reserve_bytes, 0) // 2
    else:
        budget = 64 << 20
    return max(1, min(m, max(256, budget // (v * dz_bytes))))


def dlogits_group_m(block_m: int, row_bytes: int, device: torch.device) -> int:
    """Token blocks per d/dlogits group: their hidden rows fill a share of L2."""
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20
    else:
        l2 = INTERP_L2_BYTES if interpreting() else 50 << 20
    return max(1, int(l2 * L2_SHARE_FOR_HIDDEN) // (block_m * row_bytes))


def _mm_fp32(a, b):
    """a @ b with an fp32 result and fp32 accumulation, never rounded to
    a's dtype on the way: cuBLAS writes fp32 directly for bf16/fp16 inputs
    (``out_dtype``, torch >= 2.8, CUDA); elsewhere the inputs are widened
    (exact for bf16/fp16)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def linear_logprobs_backward(h, w, bias, targets, lse, coef, inv_temp, need_h, need_w, need_b):
    """Gradients of sum_r coef[r] * logp[r] w.r.t. h [M, H], w [V, H], bias [V].

    Returns (dh in h.dtype or None, dw fp32 or None, db fp32 or None)."""
    m, hdim = h.shape
    v = w.shape[0]
    dev = h.device
    dh = torch.empty_like(h) if need_h else None
    if m == 0 or not (need_h or need_w or need_b):
        dw = torch.zeros(v, hdim, dtype=torch.float32, device=dev) if need_w else None
        db = torch.zeros(v, dtype=torch.float32, device=dev) if need_b else None
        return dh, dw, db
    dz_dtype = dz_dtype_for(h.dtype)
    # the cuBLAS GEMMs take one dtype: fp16 operands meet an fp32 dz as fp32
    w_gemm = w if w.dtype == dz_dtype else w.to(dz_dtype)
    dz_bytes = torch.empty((), dtype=dz_dtype).element_size()
    rows = dz_chunk_rows(m, v, dz_bytes, dev, reserve_bytes=2 * v * hdim * 4 if need_w else 0)
    dz_buf = torch.empty(rows, v, dtype=dz_dtype, device=dev)
    prec = dot_precision(h.dtype)
    dw = db = None
    for a in range(0, m, rows):
        b = min(a + rows, m)
        n = b - a
        dz = dz_buf[:n]
        hc = h[a:b]

        def launch(cfg, hc=hc, dz=dz, a=a, b=b, n=n):
            bm, bv = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_V"]
            group_m = dlogits_group_m(bm, hdim * h.element_size(), dev)
            _dlogits_kernel[(triton.cdiv(n, bm) * triton.cdiv(v, bv),)](
                hc, hc.stride(0), w, w.stride(0), bias if bias is not None else hc, targets[a:b], lse[a:b],
                coef[a:b], dz, dz.stride(0), n, v, hdim, inv_temp, group_m, HAS_BIAS=bias is not None,
                PREC=prec, UPCAST=upcast_for_dot(h.dtype), **cfg.all_kwargs())

        dlogits_tuner.run(tile_kind(h.dtype), (v, hdim, size_bucket(n), h.dtype, bias is not None), launch, dev)
        if need_h:
            if dz_dtype == h.dtype:
                torch.mm(dz, w_gemm, out=dh[a:b])
            else:
                dh[a:b] = _mm_fp32(dz, w_gemm)
        if need_w:
            hc_gemm = hc if hc.dtype == dz_dtype else hc.to(dz_dtype)
            part = _mm_fp32(dz.t(), hc_gemm)  # fp32 all the way: no bf16 round trip per chunk
            if dw is None:
                dw = part  # one chunk (the usual case): no zeros, no extra add
            else:
                dw += part
        if need_b:
            part = dz.sum(0, dtype=torch.float32)  # fp32 accumulator, no fp32 copy of the chunk
            db = part if db is None else db.add_(part)
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
