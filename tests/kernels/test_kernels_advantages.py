"""group_advantages: every registered estimator by hand, every path against
the reference, constant groups (and groups of one) exactly 0 with finite
gradients."""

import pytest
import torch
from kernels_testlib import DEVICE, DTYPES, FAST_IMPLS, IMPLS, assert_close, triton_ready

import rcgrpo_kernels

ESTIMATORS = tuple(rcgrpo_kernels.ADVANTAGE_ESTIMATORS)


def _run(impl, rewards, groups, **kw):
    if impl == "triton":
        triton_ready()
    return rcgrpo_kernels.group_advantages(rewards, groups, impl=impl, **kw)


def test_registry():
    assert ESTIMATORS == ("grpo", "grpo_ddof1", "dr_grpo", "rloo")
    assert rcgrpo_kernels.get_advantage_estimator("group").name == "grpo"  # the former scale= values
    assert rcgrpo_kernels.get_advantage_estimator("none").name == "dr_grpo"
    with pytest.raises(ValueError, match=r"advantage estimator must be one of \('grpo', 'grpo_ddof1', 'dr_grpo', "
                                         r"'rloo'\), got 'gae'"):
        rcgrpo_kernels.get_advantage_estimator("gae")
    with pytest.raises(ValueError, match="already registered"):
        rcgrpo_kernels.register_advantage_estimator(rcgrpo_kernels.AdvantageEstimator("rloo", False))


@pytest.mark.parametrize("impl", IMPLS)
def test_each_estimator_by_hand(impl):
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 4.0], device=DEVICE)
    g = torch.tensor([7, 7, 7, -2, -2, 5], device=DEVICE)  # a spread group, a constant one, a group of one
    pop, sample = (2.0 / 3.0) ** 0.5, 1.0  # std of 1, 2, 3 with ddof 0 and 1
    want = {
        "grpo": [-1 / (pop + 1e-6), 0.0, 1 / (pop + 1e-6)],
        "grpo_ddof1": [-1 / (sample + 1e-6), 0.0, 1 / (sample + 1e-6)],
        "dr_grpo": [-1.0, 0.0, 1.0],
        "rloo": [1.0 - 2.5, 2.0 - 2.0, 3.0 - 1.5],  # R minus the mean of the other two
    }
    for name, first_group in want.items():
        got = _run(impl, r, g, estimator=name)
        assert_close(got, torch.tensor(first_group + [0.0, 0.0, 0.0]), what=name)


def test_scale_keyword_still_works():
    r, g = torch.tensor([1.0, 3.0]), torch.tensor([0, 0])
    with pytest.warns(DeprecationWarning, match="estimator="):
        got = rcgrpo_kernels.group_advantages(r, g, scale="none")
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0]))
    # positional "group" / "none" are the aliases, no warning
    torch.testing.assert_close(rcgrpo_kernels.group_advantages(r, g, 1e-6, "none"), got)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, -7.25, 1e6])
def test_constant_group_is_exactly_zero(impl, value):
    r = torch.full((6,), value, device=DEVICE, requires_grad=True)
    g = torch.tensor([0, 0, 0, 1, 1, 2], device=DEVICE)  # incl. a group of one
    for estimator in ESTIMATORS:
        adv = _run(impl, r, g, estimator=estimator)
        assert (adv == 0).all(), (estimator, adv)
        (grad,) = torch.autograd.grad((adv * torch.arange(6.0, device=DEVICE)).sum(), r)
        assert torch.isfinite(grad).all(), estimator


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_matches_reference(impl, dtype, estimator):
    gen = torch.Generator().manual_seed(0)
    s = 45  # more than one interpreter block of 32
    rewards = torch.randn(s, generator=gen).to(DEVICE, dtype)
    groups = torch.randint(0, 9, (s,), generator=gen).to(DEVICE) * 13 - 40  # arbitrary, negative ids
    rewards[groups == groups[0]] = rewards[0]  # one constant group
    groups[-1] = 999  # and a group of one
    upstream = torch.randn(s, generator=gen).to(DEVICE)
    r_ref = rewards.detach().clone().requires_grad_()
    r = rewards.detach().clone().requires_grad_()
    # eps=1e-2: a constant group's gradient is ~1/eps and would overflow fp16
    want = rcgrpo_kernels.group_advantages(r_ref, groups, 1e-2, estimator, impl="reference")
    got = _run(impl, r, groups, eps=1e-2, estimator=estimator)
    assert got.dtype == torch.float32
    assert (got[groups == groups[0]] == 0).all() and got[-1] == 0
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


def test_bad_arguments_are_one_line_errors():
    r, g = torch.zeros(2), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="advantage estimator must be one of"):
        rcgrpo_kernels.group_advantages(r, g, estimator="batch")
    with pytest.raises(ValueError, match="seq_group has 3 elements, expected 2"):
        rcgrpo_kernels.group_advantages(r, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_group must be an integer tensor"):
        rcgrpo_kernels.group_advantages(r, torch.zeros(2))
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        rcgrpo_kernels.group_advantages(torch.zeros(2, 1), g)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        rcgrpo_kernels.group_advantages(r, g, eps=float("nan"))
