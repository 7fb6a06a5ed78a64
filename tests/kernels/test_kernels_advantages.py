"""group_advantages: by-hand values, every path against the reference,
constant groups exactly 0 with finite gradients."""

import pytest
import torch
from kernels_testlib import DEVICE, DTYPES, FAST_IMPLS, IMPLS, assert_close, triton_ready

import kernels


def _run(impl, rewards, groups, **kw):
    if impl == "triton":
        triton_ready()
    return kernels.group_advantages(rewards, groups, impl=impl, **kw)


def test_reference_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0])
    g = torch.tensor([7, 7, 7, -2, -2])
    std = (2.0 / 3.0) ** 0.5  # population std of 1, 2, 3
    want = torch.tensor([-1 / (std + 1e-6), 0.0, 1 / (std + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(kernels.group_advantages(r, g, impl="reference"), want)
    torch.testing.assert_close(kernels.group_advantages(r, g, scale="none", impl="reference"),
                               torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, -7.25, 1e6])
def test_constant_group_is_exactly_zero(impl, value):
    r = torch.full((6,), value, device=DEVICE, requires_grad=True)
    g = torch.tensor([0, 0, 0, 1, 1, 2], device=DEVICE)  # incl. a group of one
    for scale in ("group", "none"):
        adv = _run(impl, r, g, scale=scale)
        assert (adv == 0).all(), adv
        (grad,) = torch.autograd.grad((adv * torch.arange(6.0, device=DEVICE)).sum(), r)
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", ["group", "none"])
def test_matches_reference(impl, dtype, scale):
    gen = torch.Generator().manual_seed(0)
    s = 45  # more than one interpreter block of 32
    rewards = torch.randn(s, generator=gen).to(DEVICE, dtype)
    groups = torch.randint(0, 9, (s,), generator=gen).to(DEVICE) * 13 - 40  # arbitrary, negative ids
    rewards[groups == groups[0]] = rewards[0]  # one constant group
    upstream = torch.randn(s, generator=gen).to(DEVICE)
    r_ref = rewards.detach().clone().requires_grad_()
    r = rewards.detach().clone().requires_grad_()
    # eps=1e-2: a constant group's gradient is ~1/eps and would overflow fp16
    want = kernels.group_advantages(r_ref, groups, 1e-2, scale, impl="reference")
    got = _run(impl, r, groups, eps=1e-2, scale=scale)
    assert got.dtype == torch.float32
    assert (got[groups == groups[0]] == 0).all()
    assert_close(got, want, torch.float32, "advantages")
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert r.grad.dtype == dtype
    assert_close(r.grad, r_ref.grad, dtype, "drewards", grad=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_population_std_and_eps(impl):
    r = torch.tensor([0.0, 1.0], device=DEVICE)
    g = torch.tensor([3, 3], device=DEVICE)
    adv = _run(impl, r, g, eps=0.5)
    # ddof=0 std of {0, 1} is 0.5 -> (x - 0.5) / (0.5 + 0.5)
    assert_close(adv, torch.tensor([-0.5, 0.5]), what="advantages")


def test_bad_scale():
    with pytest.raises(ValueError):
        kernels.group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), scale="batch")
