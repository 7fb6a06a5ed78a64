"""token_logprobs and fused_linear_logprobs: every path against the reference,
forward values and gradients (logits / hidden, weight, bias)."""

import pytest
import torch
from kernels_testlib import DEVICE, DTYPES, FAST_IMPLS, assert_close, leaf, triton_ready

import rcgrpo_kernels
from rcgrpo_kernels import chunked


def _maybe_triton(impl):
    if impl == "triton":
        triton_ready()


def test_reference_matches_log_softmax_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    targets = torch.tensor([2, 0])
    lse = torch.logsumexp(torch.tensor([1.0, 2.0, 3.0]), 0).item()
    want = torch.tensor([3.0 - lse, -torch.log(torch.tensor(3.0)).item()])
    torch.testing.assert_close(rcgrpo_kernels.token_logprobs(logits, targets, impl="reference"), want)
    # temperature divides the logits
    t2 = rcgrpo_kernels.token_logprobs(logits, targets, 2.0, impl="reference")
    torch.testing.assert_close(t2, rcgrpo_kernels.token_logprobs(logits / 2, targets, impl="reference"))


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs(impl, dtype, temperature):
    _maybe_triton(impl)
    g = torch.Generator().manual_seed(0)
    n, v = 29, 75  # vocab not a multiple of any block size
    logits = (3 * torch.randn(n, v, generator=g)).to(DEVICE, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    upstream = torch.randn(n, generator=g).to(DEVICE)
    x_ref, x = leaf(logits), leaf(logits)
    want = rcgrpo_kernels.token_logprobs(x_ref, targets, temperature, impl="reference")
    got = rcgrpo_kernels.token_logprobs(x, targets, temperature, impl=impl)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert_close(got, want, dtype, "logp")
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, x_ref.grad, dtype, "dlogits", grad=True)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, True)])
def test_fused_linear_logprobs(impl, dtype, temperature, bias):
    _maybe_triton(impl)
    g = torch.Generator().manual_seed(1)
    n, h, v = 37, 24, 75
    hidden = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    weight = (0.3 * torch.randn(v, h, generator=g)).to(DEVICE, dtype)
    b = (0.5 * torch.randn(v, generator=g)).to(DEVICE, dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    upstream = torch.randn(n, generator=g).to(DEVICE)
    ins_ref = [leaf(hidden), leaf(weight), leaf(b)]
    ins = [leaf(hidden), leaf(weight), leaf(b)]
    want = rcgrpo_kernels.fused_linear_logprobs(ins_ref[0], ins_ref[1], targets, temperature, ins_ref[2], impl="reference")
    got = rcgrpo_kernels.fused_linear_logprobs(ins[0], ins[1], targets, temperature, ins[2], impl=impl)
    assert got.dtype == torch.float32
    assert_close(got, want, dtype, "logp")
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    for name, a, e in zip(("dhidden", "dweight", "dbias"), ins, ins_ref):
        if e is not None:
            assert a.grad.dtype == dtype
            assert_close(a.grad, e.grad, dtype, name, grad=True)


def test_chunked_many_chunks_match_one_chunk():
    """Chunk boundaries must not change anything (tiny chunks, ragged last one)."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(41, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 41, (23,), generator=g)
    a = chunked.fused_linear_logprobs(hidden, weight, targets, 0.9, chunk_rows=5)
    ga = torch.autograd.grad(a.sum(), (hidden, weight))
    b = chunked.fused_linear_logprobs(hidden, weight, targets, 0.9, chunk_rows=1000)
    gb = torch.autograd.grad(b.sum(), (hidden, weight))
    torch.testing.assert_close(a, b)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)
    logits = torch.randn(23, 41, generator=g, requires_grad=True)
    c = chunked.token_logprobs(logits, targets, chunk_rows=4)
    torch.testing.assert_close(c, rcgrpo_kernels.token_logprobs(logits, targets, impl="reference"))


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_no_grad_and_frozen_weight(impl):
    _maybe_triton(impl)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(17, 16, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(33, 16, generator=g).to(DEVICE)  # frozen lm_head
    targets = torch.randint(0, 33, (17,), generator=g).to(DEVICE)
    with torch.no_grad():
        lp = rcgrpo_kernels.fused_linear_logprobs(hidden, weight, targets, impl=impl)
    assert not lp.requires_grad
    lp = rcgrpo_kernels.fused_linear_logprobs(hidden, weight, targets, impl=impl)
    lp.sum().backward()
    assert weight.grad is None and hidden.grad is not None


def test_auto_dispatch_on_cpu_is_chunked(monkeypatch):
    called = []
    monkeypatch.setattr(chunked, "token_logprobs", lambda *a, **k: called.append(1) or torch.zeros(1))
    rcgrpo_kernels.token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long))
    assert called == [1]


def test_bad_impl_is_rejected():
    with pytest.raises(ValueError):
        rcgrpo_kernels.token_logprobs(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), impl="cuda")


@pytest.mark.skipif(DEVICE != "cuda", reason="the 65,535 grid limit only exists on a GPU")
def test_triton_more_rows_than_grid_y_limit():
    n, v = 70_001, 100
    logits = torch.randn(n, v, device="cuda")
    targets = torch.randint(0, v, (n,), device="cuda")
    got = rcgrpo_kernels.token_logprobs(logits, targets, impl="triton")
    assert_close(got, rcgrpo_kernels.token_logprobs(logits, targets, impl="reference"), what="logp")
