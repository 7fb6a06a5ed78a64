"""token_weights (the truncated-importance-sampling hook) on every path of
grpo_loss and fused_linear_grpo_loss: unit weights change nothing, planted
weights give the written-out formula, forward and backward, over loss types,
ragged sequences, weights given packed or on the loss tokens only."""

import pytest
import torch
from kernels_testlib import FAST_IMPLS, IMPLS, SEQLENS, assert_close, leaf, old_ref_for, packed_problem, ready

import rcgrpo_kernels

LOSS_TYPES = tuple(rcgrpo_kernels.LOSS_TYPES)  # every registered reduction



def _fused(impl, p, q, old, ref, **kw):
    return rcgrpo_kernels.fused_linear_grpo_loss(q["hidden"], q["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                          p["cu_seqlens"], old, ref, bias=q.get("bias"), impl=impl, **kw)


def _tis_weights(old, engine, cap):
    return torch.clamp(torch.exp(old - engine), max=cap)


def _written_out_loss(p, old, ref, weights, beta, eps_low, eps_high, loss_type, max_tokens=None):
    """The objective spelt out token by token in Python floats (no kernel code)."""
    with torch.no_grad():
        lp = rcgrpo_kernels.fused_linear_logprobs(p["hidden"], p["weight"], p["targets"], impl="reference")
    cu = p["cu_seqlens"].tolist()
    mask = p["loss_mask"].tolist()
    per_seq, total_tokens = [], 0
    for s in range(len(cu) - 1):
        terms = []
        a = float(p["advantages"][s])
        for i in range(cu[s], cu[s + 1]):
            if not mask[i]:
                continue
            r = float(torch.exp(lp[i] - old[i]))
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            term = -min(r * a, clipped * a)
            d = float(ref[i] - lp[i])
            term += beta * (float(torch.exp(torch.tensor(d))) - d - 1)
            terms.append(float(weights[i]) * term)
        per_seq.append(terms)
        total_tokens += len(terms)
    if loss_type == "grpo":
        means = [sum(t) / len(t) for t in per_seq if t]
        return sum(means) / len(means)
    total = sum(sum(t) for t in per_seq)
    if loss_type in ("bnpo", "dapo"):
        return total / total_tokens
    if loss_type == "token-sum":
        return total
    if loss_type == "seq-mean-token-sum":
        return total / sum(1 for t in per_seq if t)
    denom = max_tokens if max_tokens is not None else max(len(t) for t in per_seq)
    if loss_type == "seq-mean-token-sum-norm":
        return total / denom
    assert loss_type == "dr_grpo", loss_type
    return total / (len(per_seq) * denom)


@pytest.mark.parametrize("impl", IMPLS)
def test_unit_weights_change_nothing(impl):
    """TIS with engine log-probs equal to the trainer's: every weight is
    min(exp(0), cap) = 1, and loss and gradients are those without weights."""
    ready(impl)
    p = packed_problem(seed=11, bias=True)
    old, ref = old_ref_for(p)
    ones = _tis_weights(old, old.clone(), cap=2.0)
    assert (ones == 1).all()
    outs = []
    for w in (None, ones):
        q = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
        loss, stats = _fused(impl, p, q, old, ref, beta=0.04, token_weights=w)
        loss.backward()
        outs.append((loss, stats, q))
    (a, sa, qa), (b, sb, qb) = outs
    assert a.item() == b.item()
    assert {k: v.item() for k, v in sa.items()} == {k: v.item() for k, v in sb.items()}
    for k in ("hidden", "weight", "bias"):
        assert torch.equal(qa[k].grad, qb[k].grad), k


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_planted_mismatch_gives_the_formula(impl, loss_type):
    """Engine log-probs off the trainer's by up to ~0.6 nats, cap 1.5: some
    weights are capped, some below 1; the loss is the written-out formula and
    the gradients equal the reference path's."""
    ready(impl)
    p = packed_problem(seed=12)
    old, ref = old_ref_for(p, spread=0.25)
    g = torch.Generator().manual_seed(5)
    engine = old + 0.3 * torch.randn(old.shape, generator=g).to(old.device)
    w = _tis_weights(old, engine, cap=1.5)
    m = p["loss_mask"]
    assert (w[m] == 1.5).any() and (w[m] < 1).any()
    kw = dict(beta=0.05, eps_low=0.2, eps_high=0.28, loss_type=loss_type)
    want = _written_out_loss(p, old, ref, w, kw["beta"], kw["eps_low"], kw["eps_high"], loss_type)
    q_ref = {k: leaf(p[k]) for k in ("hidden", "weight")}
    q = {k: leaf(p[k]) for k in ("hidden", "weight")}
    ref_loss, _ = _fused("reference", p, q_ref, old, ref, token_weights=w, **kw)
    loss, _ = _fused(impl, p, q, old, ref, token_weights=w, **kw)
    assert abs(loss.item() - want) < 2e-5 * max(1.0, abs(want))
    ref_loss.backward()
    loss.backward()
    for k in ("hidden", "weight"):
        assert_close(q[k].grad, q_ref[k].grad, what="d" + k, grad=True)
    # The weights are constants: the same loss without them has another gradient.
    q0 = {k: leaf(p[k]) for k in ("hidden", "weight")}
    plain, _ = _fused(impl, p, q0, old, ref, **kw)
    plain.backward()
    assert not torch.allclose(q0["hidden"].grad, q["hidden"].grad)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_with_low_precision_inputs(impl, dtype):
    ready(impl)
    p = packed_problem(seed=13, dtype=dtype, bias=True)
    old, ref = old_ref_for(p)
    w = 0.5 + torch.rand(old.shape, generator=torch.Generator().manual_seed(2)).to(old.device)
    q_ref = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
    q = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
    want, _ = _fused("reference", p, q_ref, old, ref, beta=0.04, token_weights=w, compute_entropy=True)
    got, _ = _fused(impl, p, q, old, ref, beta=0.04, token_weights=w, compute_entropy=True)
    assert_close(got, want, dtype, "loss")
    want.backward()
    got.backward()
    for k in ("hidden", "weight", "bias"):
        assert_close(q[k].grad, q_ref[k].grad, dtype, "d" + k, grad=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_weights_on_loss_tokens_only_and_ignored_elsewhere(impl):
    """[M] weights equal [N] weights; values off the loss tokens (inf, nan)
    are never read into the loss or its gradient."""
    ready(impl)
    p = packed_problem(seed=14)
    old, ref = old_ref_for(p)
    m = p["loss_mask"]
    w = 0.25 + torch.rand(old.shape, generator=torch.Generator().manual_seed(3)).to(old.device)
    dirty = w.clone()
    dirty[~m] = float("inf")
    dirty[torch.nonzero(~m)[0]] = float("nan")
    results = []
    for weights in (w, w[m], dirty):
        q = {k: leaf(p[k]) for k in ("hidden", "weight")}
        loss, _ = _fused(impl, p, q, old, ref, beta=0.1, loss_type="bnpo", token_weights=weights)
        loss.backward()
        assert torch.isfinite(q["hidden"].grad).all()
        results.append((loss.item(), q["hidden"].grad))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) < 1e-6
        assert_close(grad, results[0][1], what="dhidden", grad=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_on_logprobs(impl, loss_type):
    """The unfused loss takes the same weights: every path against the reference."""
    ready(impl)
    p = packed_problem(seed=15)
    old, ref = old_ref_for(p)
    with torch.no_grad():
        lp = rcgrpo_kernels.fused_linear_logprobs(p["hidden"], p["weight"], p["targets"], impl="reference")
    w = _tis_weights(old, old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4)).to(old.device),
                     cap=2.0)
    args = lambda x: (x, old, ref, p["advantages"], p["loss_mask"], p["cu_seqlens"])  # noqa: E731
    a, b = leaf(lp), leaf(lp)
    want, _ = rcgrpo_kernels.grpo_loss(*args(a), beta=0.05, loss_type=loss_type, token_weights=w, impl="reference")
    got, _ = rcgrpo_kernels.grpo_loss(*args(b), beta=0.05, loss_type=loss_type, token_weights=w, impl=impl)
    assert_close(got, want, what="loss")
    want.backward()
    got.backward()
    assert_close(b.grad, a.grad, what="dlogp", grad=True)
    formula = _written_out_loss(p, old, ref, w, 0.05, 0.2, 0.2, loss_type)
    assert abs(got.item() - formula) < 2e-5 * max(1.0, abs(formula))


def test_wrong_size_is_refused():
    p = packed_problem()
    with pytest.raises(ValueError, match="token_weights has 3 elements"):
        rcgrpo_kernels.fused_linear_grpo_loss(p["hidden"], p["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                       p["cu_seqlens"], token_weights=torch.ones(3))
    n = sum(SEQLENS)
    with pytest.raises(ValueError, match="token_weights"):
        rcgrpo_kernels.grpo_loss(torch.zeros(n), None, None, p["advantages"], p["loss_mask"], p["cu_seqlens"],
                          token_weights=torch.ones(n - 1))
