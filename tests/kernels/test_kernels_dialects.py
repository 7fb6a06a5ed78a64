"""The dialects users come from (verl, TRL): dual-clip PPO, the KL
estimators, log-ratio and KL clamping, the loss aggregations and the
advantage estimators. Each is checked by hand, on every path against the
reference (forward and backward), and against the peer's loss written out
here from its documented formula on a padded [B, T] batch, so that a user
switching over gets the loss they had."""

import math

import pytest
import torch
from kernels_testlib import (
    DEVICE,
    IMPLS,
    SEQLENS,
    assert_close,
    cu_of,
    leaf,
    loss_mask_for,
    old_ref_for,
    packed_problem,
    ready,
)

import rcgrpo_kernels
from rcgrpo_kernels import kl_estimators

KL_NAMES = tuple(rcgrpo_kernels.KL_ESTIMATORS)



def _problem(seed=0, spread=0.6, seqlens=SEQLENS):
    gen = torch.Generator().manual_seed(seed)
    n, s = sum(seqlens), len(seqlens)
    base = -2.0 + torch.randn(n, generator=gen)
    return dict(
        logp=base.to(DEVICE),
        # a wide spread: ratios beyond 1.5 and below 0.5, log-ratios of either sign
        old=(base + spread * torch.randn(n, generator=gen)).to(DEVICE),
        ref=(base + spread * torch.randn(n, generator=gen)).to(DEVICE),
        adv=torch.randn(s, generator=gen).to(DEVICE),
        mask=loss_mask_for(seqlens, frac=0.8),
        cu=cu_of(seqlens),
    )


def _run(impl, t, **kw):
    x = leaf(t["logp"])
    loss, stats = rcgrpo_kernels.grpo_loss(x, kw.pop("old", t["old"]), kw.pop("ref", t["ref"]), t["adv"], t["mask"], t["cu"],
                                    impl=impl, **kw)
    loss.backward()
    return loss, stats, x.grad


def test_registry():
    assert KL_NAMES == ("k3", "k1", "k2", "abs", "k1+", "abs+", "k3+")
    with pytest.raises(ValueError, match=r"kl_estimator must be one of \('k3', .*\), got 'low_var_kl'"):
        rcgrpo_kernels.get_kl_estimator("low_var_kl")
    with pytest.raises(ValueError, match="base 'k4' is not one of"):
        rcgrpo_kernels.KLEstimator("x", "k4", "k2")


# --------------------------------------------------------------------------
# Dual clip
# --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_dual_clip_by_hand(impl):
    ready(impl)
    # one sequence of 4 loss tokens (+ its last token), A = -1: ratios 4, 2, 0.5 and 1
    logp = torch.log(torch.tensor([4.0, 2.0, 0.5, 1.0, 1.0]))
    old = torch.zeros(5)
    mask = torch.tensor([True, True, True, True, False])
    cu = torch.tensor([0, 5], dtype=torch.int32)
    adv = torch.tensor([-1.0])
    x = leaf(logp.to(DEVICE))
    loss, stats = rcgrpo_kernels.grpo_loss(x, old.to(DEVICE), None, adv.to(DEVICE), mask.to(DEVICE), cu.to(DEVICE),
                                    loss_type="token-sum", clip_ratio_c=3.0, impl=impl)
    # r=4 > c: held at c A -> 3; r=2: -min(-2, -1.2) = 2; r=0.5 < 0.8: clipped -> 0.8; r=1 -> 1
    assert loss.item() == pytest.approx(3.0 + 2.0 + 0.8 + 1.0, rel=1e-6)
    assert stats["clip_frac_lower"].item() == pytest.approx(1 / 4)
    assert stats["clip_frac"].item() == pytest.approx(1 / 4)  # the 0.5 ratio, pushed down by A < 0
    loss.backward()
    # d/dlogp of -A r = r where the unclipped branch is active: token 1 (r=2) and token 3 (r=1)
    assert_close(x.grad, torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0]), what="dlogp")
    # off: the r=4 token counts fully
    plain, stats = rcgrpo_kernels.grpo_loss(logp.to(DEVICE), old.to(DEVICE), None, adv.to(DEVICE), mask.to(DEVICE),
                                     cu.to(DEVICE), loss_type="token-sum", impl=impl)
    assert plain.item() == pytest.approx(4.0 + 2.0 + 0.8 + 1.0, rel=1e-6) and "clip_frac_lower" not in stats


# --------------------------------------------------------------------------
# KL estimators and clamps
# --------------------------------------------------------------------------
def _kl_by_hand(name, x):
    """value and d value / d logp at x = logp - ref, from Schulman's formulas."""
    value = {"k1": x, "abs": abs(x), "k2": 0.5 * x * x, "k3": math.exp(-x) + x - 1}[name.rstrip("+")]
    grad = x if name.endswith("+") or name == "k2" else {
        "k1": 1.0, "abs": math.copysign(1.0, x), "k3": 1 - math.exp(-x)}[name]
    return value, grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", KL_NAMES)
def test_each_kl_estimator_by_hand(impl, name):
    """On-policy with A = 0: the loss is beta * mean KL, its gradient beta *
    the estimator's gradient, per token; the statistic is the mean value."""
    ready(impl)
    xs = [0.7, -0.4, 1.3]
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ref = logp.clone()
    ref[:3] -= torch.tensor(xs)  # x = logp - ref
    mask = torch.tensor([True, True, True, False])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    x = leaf(logp.to(DEVICE))
    loss, stats = rcgrpo_kernels.grpo_loss(x, None, ref.to(DEVICE), torch.zeros(1, device=DEVICE), mask.to(DEVICE),
                                    cu.to(DEVICE), beta=0.5, loss_type="bnpo", kl_estimator=name, impl=impl)
    want = [_kl_by_hand(name, v) for v in xs]
    assert loss.item() == pytest.approx(0.5 * sum(v for v, _ in want) / 3, rel=1e-5)
    assert stats["kl"].item() == pytest.approx(sum(v for v, _ in want) / 3, rel=1e-5)
    loss.backward()
    assert_close(x.grad, torch.tensor([0.5 * g / 3 for _, g in want] + [0.0]), what="dlogp")


@pytest.mark.parametrize("impl", IMPLS)
def test_clamps_by_hand(impl):
    """log_ratio_clamp clamps x (and the ratio's log) with a zero derivative
    outside; kl_clamp clamps the value with a zero derivative outside."""
    ready(impl)
    logp = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    ref = torch.tensor([-1.0 - 25.0, -1.0 + 3.0, -1.0 - 0.5, 0.0])  # x = 25, -3, 0.5
    mask = torch.tensor([True, True, True, False])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    args = (None, ref.to(DEVICE), torch.zeros(1, device=DEVICE), mask.to(DEVICE), cu.to(DEVICE))
    x = leaf(logp.to(DEVICE))
    loss, stats = rcgrpo_kernels.grpo_loss(x, *args, beta=1.0, loss_type="token-sum", kl_estimator="k2",
                                    log_ratio_clamp=20.0, kl_clamp=4.0, impl=impl)
    # k2 at x clamped to 20 -> 200 -> clamped to 4; at -3 -> 4.5 -> 4; at 0.5 -> 0.125
    assert loss.item() == pytest.approx(4.0 + 4.0 + 0.125, rel=1e-6)
    loss.backward()
    assert_close(x.grad, torch.tensor([0.0, 0.0, 0.5, 0.0]), what="dlogp")
    # the ratio's log: old 30 nats below -> ratio exp(20) with the clamp, A > 0 clips it either way
    old = (logp - 30.0).to(DEVICE)
    y = leaf(logp.to(DEVICE))
    loss, stats = rcgrpo_kernels.grpo_loss(y, old, None, torch.ones(1, device=DEVICE), mask.to(DEVICE), cu.to(DEVICE),
                                    loss_type="token-sum", log_ratio_clamp=20.0, impl=impl)
    assert loss.item() == pytest.approx(-3 * 1.2, rel=1e-6) and stats["clip_frac"].item() == 1.0


@pytest.mark.parametrize("impl", ["chunked", "triton"])
@pytest.mark.parametrize("name", KL_NAMES)
@pytest.mark.parametrize("clamps", [(None, None, None), (3.0, 20.0, 10.0), (1.3, 0.3, 0.05)])
def test_dialects_match_the_reference(impl, name, clamps):
    """Every estimator with the dual clip and the clamps off, at verl's
    values, and tight enough to bind often, off-policy with eps_low != eps_high."""
    ready(impl)
    clip_c, lr_clamp, kl_clamp = clamps
    t = _problem(seed=4)
    kw = dict(eps_low=0.15, eps_high=0.28, beta=0.3, kl_estimator=name, clip_ratio_c=clip_c,
              log_ratio_clamp=lr_clamp, kl_clamp=kl_clamp, loss_type="grpo")
    want, want_stats, want_grad = _run("reference", t, **kw)
    got, stats, grad = _run(impl, t, **kw)
    assert_close(got, want, what="loss")
    assert set(stats) == set(want_stats)
    for k in stats:
        assert_close(stats[k], want_stats[k], what=k)
    assert_close(grad, want_grad, what="dlogp", grad=True)
    if clip_c is not None:
        assert 0 < want_stats["clip_frac_lower"].item() < 1  # the dual clip binds on some tokens


@pytest.mark.parametrize("impl", ["chunked", "triton"])
@pytest.mark.parametrize("name", KL_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dialects_in_the_fused_linear_loss(impl, name, dtype):
    """The same settings through the fused projection + loss (the trainer's
    --fused path), on the ragged packed problem, forward and backward."""
    ready(impl)
    p = packed_problem(seed=7, dtype=dtype, bias=True)
    old, ref = old_ref_for(p, spread=0.8)
    kw = dict(eps_low=0.15, eps_high=0.28, beta=0.3, kl_estimator=name, clip_ratio_c=1.3, log_ratio_clamp=0.6,
              kl_clamp=0.2, loss_type="seq-mean-token-sum", compute_entropy=True)
    outs = []
    for path in ("reference", impl):
        q = {k: leaf(p[k]) for k in ("hidden", "weight", "bias")}
        loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(q["hidden"], q["weight"], p["targets"], p["advantages"],
                                                     p["loss_mask"], p["cu_seqlens"], old, ref, bias=q["bias"],
                                                     impl=path, **kw)
        loss.backward()
        outs.append((loss, stats, q))
    (a, sa, qa), (b, sb, qb) = outs
    assert_close(b, a, dtype, "loss")
    assert set(sb) == set(sa) == {"clip_frac", "clip_frac_lower", "kl", "entropy"}
    assert 0 < sa["clip_frac_lower"].item() < 1
    for k in sa:
        assert_close(sb[k], sa[k], dtype, k)
    for k in ("hidden", "weight", "bias"):
        assert_close(qb[k].grad, qa[k].grad, dtype, "d" + k, grad=True)


# --------------------------------------------------------------------------
# The peers' losses, written out from their documented formulas
# --------------------------------------------------------------------------
def _padded(t):
    """The packed problem as verl/TRL see it: [B, T] rows padded on the right,
    a response mask, one advantage per row broadcast over tokens."""
    cu = t["cu"].cpu().tolist()
    rows = [(cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
    width = max(b - a for a, b in rows)
    out = {k: torch.zeros(len(rows), width) for k in ("logp", "old", "ref")}
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (a, b) in enumerate(rows):
        for k in out:
            out[k][i, :b - a] = t[k][a:b].cpu()
        mask[i, :b - a] = t["mask"][a:b].cpu()
    adv = t["adv"].cpu()[:, None].expand(-1, width)
    return out, mask, adv


def _verl_loss(t, mode, clip_c=3.0, eps_low=0.2, eps_high=0.28, beta=0.1, scale=None):
    """verl's actor loss: compute_policy_loss_vanilla (log-ratio clamped to
    +-20, dual clip at clip_ratio_c) plus kl_coef * low_var_kl (k3 of the
    ref - logp difference clamped to +-20, the value to +-10), both
    aggregated by agg_loss(loss_agg_mode) on one process."""
    p, mask, adv = _padded(t)
    m = mask.float()
    ratio = torch.exp(torch.clamp(p["logp"] - p["old"], -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(-adv * clip_c, pg), pg)
    kl = torch.clamp(p["ref"] - p["logp"], -20.0, 20.0)
    k3 = torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)

    def agg(mat):
        seq_tokens = m.sum(-1)
        if mode == "token-mean":
            return (mat * m).sum() / m.sum()
        if mode == "seq-mean-token-mean":
            keep = seq_tokens > 0
            return ((mat * m).sum(-1)[keep] / seq_tokens[keep]).sum() / keep.sum()
        if mode == "seq-mean-token-sum":
            keep = seq_tokens > 0
            return (mat * m).sum(-1)[keep].sum() / keep.sum()
        assert mode == "seq-mean-token-sum-norm"
        return (mat * m).sum() / scale

    return agg(pg) + beta * agg(k3)


VERL_MODES = {  # verl loss_agg_mode -> ours
    "token-mean": "bnpo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(VERL_MODES))
def test_verls_loss_with_verls_settings(impl, mode):
    ready(impl)
    t = _problem(seed=5, spread=1.2)
    width = max((t["cu"][1:] - t["cu"][:-1]).tolist())
    want = _verl_loss(t, mode, scale=width)
    got, stats, _ = _run(impl, t, eps_low=0.2, eps_high=0.28, beta=0.1, loss_type=VERL_MODES[mode],
                         clip_ratio_c=3.0, kl_estimator="k3", log_ratio_clamp=20.0, kl_clamp=10.0,
                         max_tokens=float(width))
    assert got.item() == pytest.approx(want.item(), rel=2e-5, abs=2e-6)
    assert stats["clip_frac_lower"].item() > 0


def _trl_loss(t, loss_type, beta=0.04, eps_low=0.2, eps_high=0.28, max_completion_length=None):
    """TRL 1.16 GRPOTrainer._compute_loss, token-level importance sampling,
    with use_bias_correction_kl=False: k3 unclamped, no dual clip."""
    p, mask, adv = _padded(t)
    m = mask.float()
    coef_1 = torch.exp(p["logp"] - p["old"])
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    d = p["ref"] - p["logp"]
    per_token = per_token + beta * (torch.exp(d) - d - 1)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    assert loss_type == "dr_grpo"
    return (per_token * m).sum() / (per_token.size(0) * max_completion_length)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_trls_loss_with_trls_settings(impl, loss_type):
    """Every row has a loss token here (TRL's grpo averages over all rows,
    ours over rows with loss tokens: the two agree then; loss_types.py)."""
    ready(impl)
    t = _problem(seed=6, seqlens=(5, 12, 3, 13, 9))
    _, mask, _ = _padded(t)
    assert mask.any(-1).all()
    budget = 16.0
    want = _trl_loss(t, loss_type, max_completion_length=budget)
    got, _, _ = _run(impl, t, eps_low=0.2, eps_high=0.28, beta=0.04, loss_type=loss_type,
                     max_tokens=budget if loss_type == "dr_grpo" else None)
    assert got.item() == pytest.approx(want.item(), rel=2e-5, abs=2e-6)


def test_the_kl_statistic_clamps_at_twenty():
    x = torch.tensor([-100.0, 100.0, 0.3])
    stat = kl_estimators.statistic(x, torch.zeros(3), "k3")
    assert torch.isfinite(stat).all()
    assert stat[0].item() == pytest.approx(math.exp(20) - 20 - 1, rel=1e-5)
