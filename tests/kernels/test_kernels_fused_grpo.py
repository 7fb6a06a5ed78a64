"""fused_linear_grpo_loss: every path against the reference (loss, stats,
dhidden, dweight, dbias) over loss types, dtypes, temperature, beta, clip
ranges, bias, old/ref given packed or gathered, and odd batches."""

import pytest
import torch
from kernels_testlib import FAST_IMPLS, SEQLENS, assert_close, leaf, old_ref_for, packed_problem, triton_ready

import rcgrpo_kernels
from rcgrpo_kernels import chunked
from rcgrpo_kernels.loss_settings import LossSettings
from rcgrpo_kernels.objective import Objective

LOSS_TYPES = tuple(rcgrpo_kernels.LOSS_TYPES)  # every registered reduction


def _compare(impl, p, old, ref, dtype=torch.float32, entropy=True, **kw):
    if impl == "triton":
        triton_ready()
    args = lambda q: (q["hidden"], q["weight"], p["targets"], p["advantages"], p["loss_mask"],  # noqa: E731
                      p["cu_seqlens"], old, ref)
    q_ref = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
    q = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
    want, want_stats = rcgrpo_kernels.fused_linear_grpo_loss(*args(q_ref), bias=q_ref["bias"], compute_entropy=entropy,
                                                      impl="reference", **kw)
    got, stats = rcgrpo_kernels.fused_linear_grpo_loss(*args(q), bias=q["bias"], compute_entropy=entropy, impl=impl, **kw)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert_close(got, want, dtype, "loss")
    assert set(stats) == set(want_stats)
    for k in stats:
        assert not stats[k].requires_grad
        assert_close(stats[k], want_stats[k], dtype, k)
    want.backward()
    got.backward()
    for k in ("hidden", "weight", "bias"):
        if q[k] is not None:
            assert q[k].grad.dtype == p[k].dtype
            assert_close(q[k].grad, q_ref[k].grad, dtype, "d" + k, grad=True)
    # rows that carry no loss get exactly zero gradient
    assert (q["hidden"].grad[~p["loss_mask"]] == 0).all()
    return stats


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_matches_reference(impl, loss_type, dtype, beta):
    p = packed_problem(dtype=dtype, bias=(beta > 0))
    old, ref = old_ref_for(p, temperature=0.8)
    stats = _compare(impl, p, old, ref, dtype, eps_low=0.1, eps_high=0.28, beta=beta, temperature=0.8,
                     loss_type=loss_type)
    assert 0 < stats["clip_frac"].item() < 1


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fp16_and_old_none(impl):
    p = packed_problem(dtype=torch.float16, seed=3)
    _compare(impl, p, None, None, torch.float16, entropy=False)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_old_ref_given_on_loss_tokens_only(impl):
    p = packed_problem(seed=4)
    old, ref = old_ref_for(p)
    m = p["loss_mask"]
    _compare(impl, p, old[m], ref[m], beta=0.1, loss_type="bnpo")


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_dr_grpo_constant(impl):
    p = packed_problem(seed=5)
    old, _ = old_ref_for(p)
    _compare(impl, p, old, None, loss_type="dr_grpo", max_tokens=64)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("which", ["one_token", "no_token"])
def test_odd_batches(impl, which):
    n = sum(SEQLENS)
    mask = torch.zeros(n, dtype=torch.bool)
    if which == "one_token":
        mask[20] = True
    p = packed_problem(mask=mask, bias=True)
    old, ref = old_ref_for(p)
    if which == "one_token":
        _compare(impl, p, old, ref, beta=0.04)
    else:
        if impl == "triton":
            triton_ready()
        h = leaf(p["hidden"])
        loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(h, p["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                                     p["cu_seqlens"], old, ref, beta=0.04, impl=impl)
        loss.backward()
        assert loss.item() == 0.0 and (h.grad == 0).all()
        assert all(v.item() == 0.0 for v in stats.values())


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_targets_of_non_loss_rows_are_never_read(impl):
    """Only loss rows are gathered: out-of-range ids elsewhere change nothing."""
    if impl == "triton":
        triton_ready()
    p = packed_problem(seed=6)
    bad = p["targets"].clone()
    bad[~p["loss_mask"]] = 10_000
    args = (p["advantages"], p["loss_mask"], p["cu_seqlens"])
    a, _ = rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["targets"], *args, impl=impl)
    b, _ = rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], bad, *args, impl=impl)
    assert a.item() == b.item()


def test_chunked_chunks_and_no_grad():
    p = packed_problem(seed=7, bias=True)
    old, ref = old_ref_for(p)
    outs = []
    for rows in (2, 5, None):
        q = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
        loss, stats = chunked.fused_linear_grpo_loss(q["hidden"], q["weight"], p["targets"], p["advantages"],
                                                     p["loss_mask"], p["cu_seqlens"], old, ref, bias=q["bias"],
                                                     settings=LossSettings(Objective(beta=0.04), compute_entropy=True),
                                                     chunk_rows=rows)
        (2.0 * loss).backward()  # the upstream gradient must be applied
        outs.append((loss, stats, q))
    for loss, _stats, q in outs[:2]:
        assert_close(loss, outs[2][0], what="loss")
        for k in ("hidden", "weight", "bias"):
            assert_close(q[k].grad, outs[2][2][k].grad, what=k, grad=True)
    with torch.no_grad():
        loss, _ = chunked.fused_linear_grpo_loss(p["hidden"], p["weight"], p["targets"], p["advantages"],
                                                 p["loss_mask"], p["cu_seqlens"], old, ref, bias=p["bias"],
                                                 settings=LossSettings(Objective(beta=0.04)))
    assert_close(loss, outs[2][0], what="no-grad loss")


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_entropy_only_when_asked(impl):
    if impl == "triton":
        triton_ready()
    p = packed_problem(seed=8)
    _, stats = rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["targets"], p["advantages"],
                                              p["loss_mask"], p["cu_seqlens"], impl=impl)
    assert set(stats) == {"clip_frac"}


def test_validation():
    p = packed_problem()
    with pytest.raises(ValueError, match="ref_logp"):
        rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                       p["cu_seqlens"], beta=0.1)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"].t(), p["targets"], p["advantages"],
                                       p["loss_mask"], p["cu_seqlens"])
    old = torch.zeros(3)
    with pytest.raises(ValueError, match="expected"):
        rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                       p["cu_seqlens"], old_logp=old, impl="chunked")
