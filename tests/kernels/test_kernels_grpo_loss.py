"""grpo_loss: the reference against numbers worked out by hand, then every path
against the reference over loss types, beta, clip ranges and odd batches."""

import math

import pytest
import torch
from kernels_testlib import DEVICE, FAST_IMPLS, IMPLS, SEQLENS, assert_close, cu_of, loss_mask_for, triton_ready

import rcgrpo_kernels

LOSS_TYPES = tuple(rcgrpo_kernels.LOSS_TYPES)  # every registered reduction


def _run(impl, *args, **kw):
    if impl == "triton":
        triton_ready()
    return rcgrpo_kernels.grpo_loss(*args, impl=impl, **kw)


def _hand_batch():
    # seq0 = tokens 0..2, seq1 = tokens 3..4; tokens 2 and 4 carry no loss and
    # hold values that would overflow exp() if they leaked into the maths.
    logp = torch.tensor([math.log(0.5), math.log(0.25), 50.0, math.log(0.1), -1e4])
    old = torch.tensor([math.log(0.4), math.log(0.25), -1e4, math.log(0.2), 80.0])
    ref = logp.clone()
    ref[1] = math.log(0.5)
    ref[4] = 1e4
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([True, True, False, True, False])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    return logp, old, ref, adv, mask, cu


@pytest.mark.parametrize("impl", IMPLS)
def test_by_hand(impl):
    logp, old, ref, adv, mask, cu = (t.to(DEVICE) for t in _hand_batch())
    # token 0: r = 1.25 > 1 + 0.1 with A > 0 -> clipped, l = -1.1, dl = 0
    # token 1: r = 1 -> l = -1 (+ beta * k3), dl = -1 (+ beta * (1 - 2))
    # token 3: r = 0.5 < 1 - 0.2 with A < 0 -> clipped, l = 0.8 * 2 = 1.6, dl = 0
    k3 = 2.0 - math.log(2.0) - 1.0
    beta = 0.1
    l1 = -1.0 + beta * k3
    cases = {
        "grpo": ((-1.1 + l1) / 2 + 1.6) / 2,
        "bnpo": (-1.1 + l1 + 1.6) / 3,
        "dapo": (-1.1 + l1 + 1.6) / 3,
        "dr_grpo": (-1.1 + l1 + 1.6) / (2 * 2),  # S=2, max_tokens = 2
    }
    w1 = {"grpo": 1 / 4, "bnpo": 1 / 3, "dapo": 1 / 3, "dr_grpo": 1 / 4}
    for loss_type, want in cases.items():
        x = logp.clone().requires_grad_()
        loss, stats = _run(impl, x, old, ref, adv, mask, cu, 0.2, 0.1, beta, loss_type)
        assert loss.item() == pytest.approx(want, rel=1e-5), loss_type
        assert stats["clip_frac"].item() == pytest.approx(2 / 3)
        assert stats["kl"].item() == pytest.approx(k3 / 3, rel=1e-5)
        (grad,) = torch.autograd.grad(loss, x)
        want_grad = torch.zeros(5)
        want_grad[1] = (-1.0 + beta * (1.0 - 2.0)) * w1[loss_type]
        assert_close(grad, want_grad, what=f"dlogp {loss_type}")
    loss, _ = _run(impl, logp, old, ref, adv, mask, cu, 0.2, 0.1, beta, "dr_grpo", max_tokens=10)
    assert loss.item() == pytest.approx((-1.1 + l1 + 1.6) / (2 * 10), rel=1e-5)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(impl, loss_type, beta, with_old, dtype):
    gen = torch.Generator().manual_seed(0)
    n, s = sum(SEQLENS), len(SEQLENS)
    cu = cu_of(SEQLENS)
    mask = loss_mask_for(SEQLENS)
    base = -2.0 + torch.randn(n, generator=gen)
    logp = base.to(DEVICE, dtype)
    old = (base + 0.3 * torch.randn(n, generator=gen)).to(DEVICE) if with_old else None
    ref = (base + 0.3 * torch.randn(n, generator=gen)).to(DEVICE)
    adv = torch.randn(s, generator=gen).to(DEVICE)
    x_ref = logp.detach().clone().requires_grad_()
    x = logp.detach().clone().requires_grad_()
    args = (old, ref, adv, mask, cu, 0.1, 0.28, beta, loss_type)  # eps_low != eps_high
    want, want_stats = rcgrpo_kernels.grpo_loss(x_ref, *args, impl="reference")
    got, stats = _run(impl, x, *args)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert_close(got, want, what="loss")
    assert set(stats) == set(want_stats) == {"clip_frac", "kl"}
    for k in stats:
        assert not stats[k].requires_grad
        assert_close(stats[k], want_stats[k], what=k)
    if with_old:
        assert 0 < stats["clip_frac"].item() < 1  # both branches of the min are exercised
    want.backward()
    got.backward()
    assert x.grad.dtype == dtype
    assert_close(x.grad, x_ref.grad, dtype, "dlogp", grad=True)
    assert (x.grad[~mask] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_odd_batches(impl, loss_type):
    cu = cu_of(SEQLENS)
    n, s = sum(SEQLENS), len(SEQLENS)
    adv = torch.linspace(-1, 1, s, device=DEVICE)
    logp = torch.full((n,), -1.5, device=DEVICE)
    # only one token counts
    one = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    one[7] = True
    x = logp.clone().requires_grad_()
    loss, stats = _run(impl, x, None, None, adv, one, cu, loss_type=loss_type)
    # token 7 lies in the third sequence (5, 0, |12|, ...); dr_grpo divides by S * 1
    a = adv[2].item() / (s if loss_type == "dr_grpo" else 1)
    assert loss.item() == pytest.approx(-a, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, x)
    assert grad[7].item() == pytest.approx(-a, rel=1e-6) and grad.abs().sum().item() == pytest.approx(abs(a), rel=1e-6)
    assert set(stats) == {"clip_frac"}
    # no token counts at all: a zero loss with zero gradient, never NaN
    none = torch.zeros(n, dtype=torch.bool, device=DEVICE)
    x = logp.clone().requires_grad_()
    loss, stats = _run(impl, x, None, None, adv, none, cu, loss_type=loss_type)
    (grad,) = torch.autograd.grad(loss, x)
    assert loss.item() == 0.0 and (grad == 0).all() and stats["clip_frac"].item() == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_grpo_ignores_sequences_without_loss_tokens(impl):
    """A sequence with no loss token neither adds a zero to the grpo mean nor
    changes bnpo; it does count in dr_grpo's S."""
    cu = cu_of([3, 3, 3])
    mask = torch.tensor([1, 1, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool, device=DEVICE)
    logp = torch.full((9,), -1.0, device=DEVICE)
    adv = torch.tensor([1.0, 5.0, 2.0], device=DEVICE)
    loss, _ = _run(impl, logp, None, None, adv, mask, cu, loss_type="grpo")
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)
    loss, _ = _run(impl, logp, None, None, adv, mask, cu, loss_type="dr_grpo")
    assert loss.item() == pytest.approx(-(1.0 + 1.0 + 2.0) / (3 * 2))


def test_validation():
    logp = torch.zeros(4)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    mask = torch.ones(4, dtype=torch.bool)
    adv = torch.zeros(1)
    with pytest.raises(ValueError, match="ref_logp"):
        rcgrpo_kernels.grpo_loss(logp, None, None, adv, mask, cu, beta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        rcgrpo_kernels.grpo_loss(logp, None, None, adv, mask, cu, loss_type="sapo")
    with pytest.raises(ValueError, match="advantages"):
        rcgrpo_kernels.grpo_loss(logp, None, None, torch.zeros(2), mask, cu)
