"""The fused-linear Triton path under every tile config, and the pieces that
plan its launches: vocabulary splits, the d/dlogits program order, d/dlogits
chunking and dtype, fp32 weight-gradient accumulation, mixed input dtypes.

Kernels run in the interpreter here (on a GPU, on CUDA); shapes put several
vocabulary tiles in each split, ragged last tiles, splits, K tiles, token
chunks and token groups."""

import math

import pytest
import torch
from kernels_testlib import DEVICE, assert_close, leaf, old_ref_for, packed_problem, triton_ready

import rcgrpo_kernels
import rcgrpo_kernels.triton.fused_linear_logprob as flp  # noqa: E402 (after TRITON_INTERPRET is set by conftest)

# the interpreter's tiles, then "the i-th config of each kind" for every i
FORCED = [flp.INTERP_CONFIG] + list(range(max(len(c) for c in flp.CONFIGS.values())))
FORCED_IDS = ["interp"] + [f"config{i}" for i in FORCED[1:]]
GPU_CONFIGS = list({id(c): c for c in flp.GPU_CONFIGS}.values())
HDIM = 40  # not a multiple of any BLOCK_K: the K loop's last tile is masked


def _vocab_for(cfg) -> int:
    # 300 for the interpreter's 32-wide tiles (the example); for the GPU
    # tiles about 12 tiles, so that each of several splits holds several tiles
    bv = cfg.kwargs["BLOCK_V"]
    return 300 if bv == 32 else 12 * bv - bv // 3


def _sms(device):
    return flp.sm_count(torch.device(device))


@pytest.fixture
def small_chunks(monkeypatch):
    """Backward in ragged 7-row chunks, d/dlogits token groups of 2 blocks."""
    monkeypatch.setattr(flp, "dz_chunk_rows", lambda m, *a, **k: min(m, 7))
    monkeypatch.setattr(flp, "dlogits_group_m", lambda *a: 2)


@pytest.mark.parametrize("forced", FORCED, ids=FORCED_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_linear_logprobs_every_config(forced, dtype, small_chunks):
    triton_ready()
    cfg = flp.config_for(dtype, False, forced)
    v = _vocab_for(cfg)
    n = 29  # two 16-row blocks (the second ragged) or one ragged GPU block
    splits, split_len = flp.vocab_splits(n, v, cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_V"], _sms(DEVICE))
    assert splits >= 2 and split_len // cfg.kwargs["BLOCK_V"] >= 3, "shape must exercise the split merge"
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(n, HDIM, generator=g).to(DEVICE, dtype)
    weight = (0.3 * torch.randn(v, HDIM, generator=g)).to(DEVICE, dtype)
    bias = (0.5 * torch.randn(v, generator=g)).to(DEVICE, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    targets[-1] = v - 1  # a target in the ragged last tile
    upstream = torch.randn(n, generator=g).to(DEVICE)
    ins_ref = [leaf(hidden), leaf(weight), leaf(bias)]
    ins = [leaf(hidden), leaf(weight), leaf(bias)]
    want = rcgrpo_kernels.fused_linear_logprobs(ins_ref[0], ins_ref[1], targets, 0.8, ins_ref[2], impl="reference")
    with flp.forced_config(forced):
        got = rcgrpo_kernels.fused_linear_logprobs(ins[0], ins[1], targets, 0.8, ins[2], impl="triton")
        (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert_close(got, want, dtype, "logp")
    for name, a, e in zip(("dhidden", "dweight", "dbias"), ins, ins_ref):
        assert a.grad.dtype == dtype
        assert_close(a.grad, e.grad, dtype, name, grad=True)


@pytest.mark.parametrize("forced", FORCED, ids=FORCED_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_grpo_loss_every_config(forced, dtype, small_chunks):
    """With entropy: the forward runs the entropy kind's configs, the backward the plain ones."""
    triton_ready()
    p = packed_problem(hdim=HDIM, vocab=_vocab_for(flp.config_for(dtype, True, forced)), dtype=dtype, seed=12)
    old, ref = old_ref_for(p)
    args = lambda q: (q["hidden"], q["weight"], p["targets"], p["advantages"], p["loss_mask"],  # noqa: E731
                      p["cu_seqlens"], old, ref)
    q_ref = {k: leaf(p[k]) for k in ("hidden", "weight")}
    q = {k: leaf(p[k]) for k in ("hidden", "weight")}
    kw = dict(beta=0.04, compute_entropy=True)
    want, want_stats = rcgrpo_kernels.fused_linear_grpo_loss(*args(q_ref), impl="reference", **kw)
    with flp.forced_config(forced):
        got, stats = rcgrpo_kernels.fused_linear_grpo_loss(*args(q), impl="triton", **kw)
        got.backward()
    want.backward()
    assert_close(got, want, dtype, "loss")
    for k in want_stats:
        assert_close(stats[k], want_stats[k], dtype, k)
    for k in q:
        assert_close(q[k].grad, q_ref[k].grad, dtype, "d" + k, grad=True)


# ---------------------------------------------------------------- launch plans
def _wave_efficiency(m, v, bm, bv, sms, splits, split_len):
    """Useful tile work over the tile slots of the waves the grid occupies."""
    tiles, t = math.ceil(v / bv), split_len // bv
    programs = math.ceil(m / bm) * splits
    waves = math.ceil(programs / (2 * sms))
    return math.ceil(m / bm) * tiles / (waves * 2 * sms * t)


@pytest.mark.parametrize("m", [512, 4096, 16384])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: "M{BLOCK_M}-V{BLOCK_V}-K{BLOCK_K}".format(**c.kwargs)
                         + f"-w{c.num_warps}")
def test_vocab_splits_fill_whole_waves_on_an_h200(m, cfg):
    bm, bv = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_V"]
    v = 151_936
    splits, split_len = flp.vocab_splits(m, v, bm, bv, 132)
    assert split_len % bv == 0
    assert (splits - 1) * split_len < v <= splits * split_len  # covers V, only the last split ragged
    eff = _wave_efficiency(m, v, bm, bv, 132, splits, split_len)
    assert eff >= 0.95, f"{splits} splits x {math.ceil(m / bm)} blocks: {eff:.3f} of the waves' tile slots"
    # the plan it replaces (about 4 programs per SM, whatever the config) left
    # a part-filled wave: 4,096 tokens in 128-row blocks made 288 programs
    if m == 4096 and bm == 128:
        assert eff > _wave_efficiency(m, v, bm, bv, 132, 9, math.ceil(math.ceil(v / 9) / bv) * bv) + 0.1


def test_vocab_splits_small_problems():
    assert flp.vocab_splits(5, 20, 16, 32, 132) == (1, 32)  # one tile: no split
    splits, split_len = flp.vocab_splits(1, 151_936, 64, 128, 132)
    assert splits >= 132  # a single token block is spread over every SM
    assert _wave_efficiency(1, 151_936, 64, 128, 132, splits, split_len) >= 0.85


@pytest.mark.skipif(DEVICE == "cuda", reason="the order is checked through the interpreter")
@pytest.mark.parametrize("n_m,n_v,group", [(7, 5, 3), (4, 6, 1), (3, 4, 8)])
def test_dlogits_programs_walk_the_vocabulary_per_token_group(n_m, n_v, group):
    import triton
    import triton.language as tl

    triton_ready()

    @triton.jit
    def order_kernel(OUT, n_m, n_v, group):
        pid = tl.program_id(0)
        pm, pv = flp.grouped_tile(pid, n_m, n_v, group)
        tl.store(OUT + 2 * pid, pm)
        tl.store(OUT + 2 * pid + 1, pv)

    out = torch.full((n_m * n_v, 2), -1, dtype=torch.int32)
    order_kernel[(n_m * n_v,)](out, n_m, n_v, group)
    tiles = [tuple(t) for t in out.tolist()]
    assert sorted(tiles) == [(i, j) for i in range(n_m) for j in range(n_v)]  # every tile exactly once
    # the weight tile changes only between token groups' sweeps: W streams once per group
    changes = sum(1 for a, b in zip(tiles, tiles[1:]) if a[1] != b[1])
    assert changes == n_v * math.ceil(n_m / group) - 1
    # token blocks stay inside their group
    for pid, (pm, _) in enumerate(tiles):
        g0 = (pid // (group * n_v)) * group
        assert g0 <= pm < g0 + group


def test_dz_chunk_rows_from_free_memory(monkeypatch):
    cuda = torch.device("cuda")
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (40 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 2 * gib)
    v, row = 151_936, 151_936 * 2
    # (40 + 4 GiB free - 4 GiB reserved) / 2 -> 20 GiB of bf16 rows: all 16,384 rows in one chunk
    assert flp.dz_chunk_rows(16_384, v, 2, cuda, reserve_bytes=4 * gib) == 16_384
    assert flp.dz_chunk_rows(100_000, v, 2, cuda, reserve_bytes=4 * gib) == 20 * gib // row
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    assert flp.dz_chunk_rows(16_384, v, 2, cuda) == gib // 2 // row
    assert flp.dz_chunk_rows(16_384, v, 2, cuda, reserve_bytes=2 * gib) == 256  # floor


def test_tuner_times_each_config_once_per_key(monkeypatch):
    import triton.testing

    from rcgrpo_kernels.triton import common

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.delenv("KERNELS_AUTOTUNE", raising=False)
    cfgs = flp.CONFIGS["bf16"]
    cost = {id(c): t for c, t in zip(cfgs, (3.0, 1.0, 2.0, 4.0))}
    timed = []

    def fake_bench(fn, **_):
        return fn()

    def launch(cfg):
        timed.append(cfg)
        return cost[id(cfg)]

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    tuner = common.Tuner({"a": cfgs, "b": cfgs[:2]}, flp.INTERP_CONFIG)
    cuda = torch.device("cuda")
    assert tuner.pick("a", "k", launch, cuda) is cfgs[1]
    assert len(timed) == 4
    assert tuner.pick("a", "k", launch, cuda) is cfgs[1] and len(timed) == 4  # cached
    tuner.pick("a", "k2", launch, cuda)
    assert len(timed) == 8  # a new key is timed again
    tuner.pick("b", "k", launch, cuda)
    assert len(timed) == 10  # another kind times its own list
    tuner.forced = cfgs[3]
    assert tuner.pick("a", "k3", launch, cuda) is cfgs[3] and len(timed) == 10
    assert tuner.pick("b", "k", launch, cuda) is cfgs[1]  # not one of b's: b's own choice
    tuner.forced = 3
    assert tuner.pick("b", "k4", launch, cuda) is cfgs[1]  # b has two: its last


def test_tuning_keys_carry_token_bucket_and_entropy(monkeypatch):
    triton_ready()
    keys = []
    real = flp.partials_tuner.run
    monkeypatch.setattr(flp.partials_tuner, "run", lambda kind, key, *a: keys.append(key) or real(kind, key, *a))
    g = torch.Generator().manual_seed(13)
    w = torch.randn(64, 16, generator=g).to(DEVICE)
    for n, ent in ((20, False), (20, True), (40, False), (60, False)):
        h = torch.randn(n, 16, generator=g).to(DEVICE)
        flp.forward_partials(h, w, None, torch.zeros(n, dtype=torch.long, device=DEVICE), 1.0, ent)
    assert len(set(keys)) == 3  # 20 / 20 + entropy / 40 and 60 share a power-of-two bucket
    assert keys[2] == keys[3] != keys[0] != keys[1]


# ------------------------------------------------------------------ precision
@pytest.mark.parametrize("rows", [None, 100])
def test_bf16_weight_gradient_is_accumulated_and_returned_in_fp32(rows, monkeypatch):
    """dW is the fp32 sum over chunks of the exact products dz_c^T h_c of the
    bf16 d/dlogits and hidden chunks: no rounding to bf16 per chunk (which
    the old path did, an error of up to 2^-9 of each chunk's sum). The GEMM
    inputs are recorded to compute the exact sum in fp64; one chunk takes
    the fast path, 100-row chunks sum six. (The recorded dz, not a
    recomputed one, is the baseline: Triton's interpreter truncates fp32 ->
    bf16 stores instead of rounding them, a bias of ~2^-9 a GPU does not have.)"""
    triton_ready()
    if rows is not None:
        monkeypatch.setattr(flp, "dz_chunk_rows", lambda m, *a, **k: rows)
    gemms = []
    real = flp._mm_fp32
    monkeypatch.setattr(flp, "_mm_fp32", lambda a, b: gemms.append((a.clone(), b.clone())) or real(a, b))
    g = torch.Generator().manual_seed(14)
    n, hd, v = 512, 32, 48
    h = torch.rand(n, hd, generator=g).add_(0.5).to(DEVICE, torch.bfloat16)  # positive: coherent column sums
    w = torch.randn(v, hd, generator=g).to(DEVICE, torch.bfloat16)
    coef = torch.full((n,), 1.0 / n, device=DEVICE)
    targets = torch.zeros(n, dtype=torch.long, device=DEVICE)
    _, lse = flp.linear_logprobs_forward(h, w, None, targets, 1.0)
    _, dw, _ = flp.linear_logprobs_backward(h, w, None, targets, lse, coef, 1.0, False, True, False)
    assert dw.dtype == torch.float32
    assert len(gemms) == (1 if rows is None else -(-n // rows))
    assert all(a.dtype == b.dtype == torch.bfloat16 for a, b in gemms)
    exact = sum(a.double() @ b.double() for a, b in gemms)
    rel = ((dw.double() - exact).abs() / exact.abs().clamp(min=1e-30)).cpu()
    # fp32 summation of 512 same-signed terms: ~1e-6; a bf16 rounding: up to 2e-3
    assert rel.max() < 1e-4, f"max relative error {rel.max():.2e}"
    # and the recorded d/dlogits are the true ones, to bf16 rounding
    z = h.double() @ w.double().t()
    dz = coef.double()[:, None] * (torch.nn.functional.one_hot(targets, v).double() - torch.softmax(z, -1))
    assert_close(dw, dz.t() @ h.double(), torch.bfloat16, "dweight", grad=True)


def test_fp16_gradients_survive_tiny_dlogits(monkeypatch):
    """fp16 inputs, V = 300, loss weights 1e-3: most d/dlogits entries are
    ~1e-8, under fp16's subnormal range; stored in fp16 they would vanish and
    take dhidden's -E_p[w] term with them."""
    triton_ready()
    g = torch.Generator().manual_seed(15)
    n, hd, v = 40, 32, 300
    hidden = torch.randn(n, hd, generator=g).to(DEVICE, torch.float16)
    weight = (0.5 * torch.randn(v, hd, generator=g)).to(DEVICE, torch.float16)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    upstream = torch.full((n,), 1e-3, device=DEVICE)
    a, b = leaf(hidden), leaf(hidden)
    (rcgrpo_kernels.fused_linear_logprobs(a, weight, targets, impl="reference") * upstream).sum().backward()
    (rcgrpo_kernels.fused_linear_logprobs(b, weight, targets, impl="triton") * upstream).sum().backward()
    assert_close(b.grad, a.grad, torch.float16, "dhidden", grad=True)
    assert flp.dz_dtype_for(torch.float16) != torch.float16


def test_mixed_dtypes_round_the_fp32_operand_down():
    h16 = torch.randn(4, 8).bfloat16()
    w32 = torch.randn(6, 8)
    h, w = flp.as_compute_pair(h16, w32)
    assert h is h16 and w.dtype == torch.bfloat16  # hidden states are not copied up
    h, w = flp.as_compute_pair(w32[:4], h16[:3].half())
    assert h.dtype == w.dtype == torch.float16


def test_mixed_bf16_hidden_fp32_master_weight():
    """Autocast hidden states with an fp32 master lm_head weight: the weight
    gradient comes back in fp32, and the values are those of the weight
    rounded to bf16 (the dtype the tiles compute in)."""
    triton_ready()
    g = torch.Generator().manual_seed(16)
    n, v = 37, 75
    hidden = torch.randn(n, HDIM, generator=g).to(DEVICE, torch.bfloat16)
    weight = (0.3 * torch.randn(v, HDIM, generator=g)).to(DEVICE)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    h_ref, w_ref = leaf(hidden.float()), leaf(weight.bfloat16().float())
    h, w = leaf(hidden), leaf(weight)
    want = rcgrpo_kernels.fused_linear_logprobs(h_ref, w_ref, targets, impl="reference")
    got = rcgrpo_kernels.fused_linear_logprobs(h, w, targets, impl="triton")
    want.sum().backward()
    got.sum().backward()
    assert_close(got, want, torch.bfloat16, "logp")
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    assert_close(w.grad, w_ref.grad, torch.bfloat16, "dweight", grad=True)
    assert_close(h.grad, h_ref.grad, torch.bfloat16, "dhidden", grad=True)
