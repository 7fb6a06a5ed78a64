"""Edge cases on every path: NaN never hidden, -inf blocks, per-token inputs
given on the loss tokens only, values off the mask never read, one-line
errors at the public door, and the edge grid (groups of one, constant
groups, one-token sequences, a 70,000-token sequence, masked -inf logits,
eps_low != eps_high, every combination of inputs that require grad)."""

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

NAN, INF = float("nan"), float("inf")



def _token_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, s = sum(SEQLENS), len(SEQLENS)
    base = -2.0 + torch.randn(n, generator=gen)
    return dict(
        logp=base.to(DEVICE),
        old=(base + 0.3 * torch.randn(n, generator=gen)).to(DEVICE),
        ref=(base + 0.3 * torch.randn(n, generator=gen)).to(DEVICE),
        adv=torch.randn(s, generator=gen).to(DEVICE),
        mask=loss_mask_for(SEQLENS),
        cu=cu_of(SEQLENS),
        weights=(0.5 + torch.rand(n, generator=gen)).to(DEVICE),
    )


def _loss(impl, t, logp=None, **kw):
    kw.setdefault("beta", 0.04)
    return rcgrpo_kernels.grpo_loss(t["logp"] if logp is None else logp, kw.pop("old", t["old"]), kw.pop("ref", t["ref"]),
                             kw.pop("adv", t["adv"]), t["mask"], t["cu"], impl=impl, **kw)


def _first_loss_token(mask):
    return int(mask.nonzero()[0])


# --------------------------------------------------------------------------
# 1. NaN on a loss token makes the loss NaN on every path
# --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("where,beta", [(w, b) for w in ("logp", "old", "ref", "adv", "weights") for b in (0.0, 0.04)
                                        if (w, b) != ("ref", 0.0)])  # an unweighted reference is not in the loss
def test_nan_on_a_loss_token_is_never_hidden(impl, where, beta):
    ready(impl)
    t = _token_problem()
    i = _first_loss_token(t["mask"])
    bad = dict(t)
    if where == "adv":
        seq = int(torch.searchsorted(t["cu"][1:].long().cpu(), torch.tensor(i), right=True))
        bad["adv"] = t["adv"].clone()
        bad["adv"][seq] = NAN
    else:
        bad[where] = t[where].clone()
        bad[where][i] = NAN
    x = leaf(bad["logp"])
    loss, _ = _loss(impl, bad, logp=x, beta=beta, token_weights=bad["weights"])
    assert math.isnan(loss.item()), f"{where}: loss {loss.item()} hides the NaN"
    loss.backward()
    assert not torch.isfinite(x.grad).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_hidden_row_on_a_loss_token_gives_a_nan_loss(impl):
    ready(impl)
    p = packed_problem(seed=3)
    old, ref = old_ref_for(p)
    i = _first_loss_token(p["loss_mask"])
    hidden = p["hidden"].clone()
    hidden[i] = NAN
    loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(hidden, p["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                             p["cu_seqlens"], old, ref, beta=0.0, impl=impl)
    assert math.isnan(loss.item())


# --------------------------------------------------------------------------
# 4. Values off the loss tokens are never read into the maths
# --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("poison", [NAN, -INF, INF])
def test_values_off_the_mask_change_nothing(impl, poison):
    ready(impl)
    t = _token_problem(seed=1)
    off = ~t["mask"]
    # a sequence without loss tokens: SEQLENS has an empty one and a one-token one
    cu = t["cu"].cpu().tolist()
    empty_seqs = [s for s in range(len(cu) - 1) if not t["mask"][cu[s]:cu[s + 1]].any()]
    assert empty_seqs
    bad = dict(t)
    for key in ("logp", "old", "ref", "weights"):
        bad[key] = torch.where(off, torch.full_like(t[key], poison), t[key])
    bad["adv"] = t["adv"].clone()
    bad["adv"][empty_seqs] = NAN
    outs = []
    for inputs in (t, bad):
        x = leaf(inputs["logp"])
        loss, stats = _loss(impl, inputs, logp=x, token_weights=inputs["weights"], clip_ratio_c=3.0)
        loss.backward()
        outs.append((loss, stats, x.grad))
    (a, sa, ga), (b, sb, gb) = outs
    assert torch.isfinite(b) and torch.isfinite(gb).all()
    assert_close(b, a, what="loss")
    assert_close(gb, ga, what="dlogp", grad=True)
    assert (gb[off] == 0).all()
    for k in sa:
        assert_close(sb[k], sa[k], what=k)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_hidden_rows_off_the_mask_change_nothing(impl):
    ready(impl)
    p = packed_problem(seed=4)
    old, ref = old_ref_for(p)
    off = ~p["loss_mask"]
    outs = []
    for hidden in (p["hidden"], torch.where(off[:, None], torch.full_like(p["hidden"], NAN), p["hidden"])):
        h, w = leaf(hidden), leaf(p["weight"])
        loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(h, w, p["targets"], p["advantages"], p["loss_mask"],
                                                 p["cu_seqlens"], old, ref, beta=0.04, impl=impl)
        loss.backward()
        outs.append((loss, h.grad, w.grad))
    assert_close(outs[1][0], outs[0][0], what="loss")
    assert_close(outs[1][1], outs[0][1], what="dhidden", grad=True)
    assert_close(outs[1][2], outs[0][2], what="dweight", grad=True)


# --------------------------------------------------------------------------
# 2. A leading block of -inf logits (top-k / top-p masking)
# --------------------------------------------------------------------------
# Triton's interpreter on a CPU takes ~2.5 s a dtype here: those cases are slow.
@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.slow) if i == "triton" else i for i in IMPLS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_all_but_a_few_logits_masked(impl, dtype):
    ready(impl)
    gen = torch.Generator().manual_seed(5)
    # the kept entries sit past the first block: the interpreter's (64) and a GPU's (4,096)
    n, v = 9, 4160
    logits = torch.full((n, v), -INF)
    keep = torch.stack([torch.randperm(40, generator=gen)[:10] + (v - 40) for _ in range(n)])
    logits.scatter_(1, keep, torch.randn(n, 10, generator=gen))
    logits[0, 5] = 1.0  # a row whose first block is not all -inf, too
    targets = keep[:, 0].clone()
    targets[0] = 5
    logits = logits.to(DEVICE, dtype)
    targets = targets.to(DEVICE)
    want_x, x = leaf(logits), leaf(logits)
    want = rcgrpo_kernels.token_logprobs(want_x, targets, 0.7, impl="reference")
    got = rcgrpo_kernels.token_logprobs(x, targets, 0.7, impl=impl)
    assert_close(got, want, what="logp")
    upstream = torch.randn(n, generator=gen).to(DEVICE)
    (want * upstream).sum().backward()
    (got * upstream).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert_close(x.grad, want_x.grad, dtype, "dlogits", grad=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_lm_head_bias_of_minus_inf_on_the_first_tiles(impl):
    """The fused sweep's first vocabulary tiles all -inf (a bias that bans
    tokens): log-probs, entropy and gradients stay those of the reference."""
    ready(impl)
    p = packed_problem(seed=6, bias=True, vocab=150)
    bias = p["bias"].clone()
    bias[:70] = -INF
    targets = torch.where(p["targets"] < 70, p["targets"] + 70, p["targets"])
    old, _ = old_ref_for(dict(p, bias=bias, targets=targets))
    outs = []
    for path in ("reference", impl):
        h, w = leaf(p["hidden"]), leaf(p["weight"])
        loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(h, w, targets, p["advantages"], p["loss_mask"], p["cu_seqlens"],
                                                     old, bias=bias, compute_entropy=True, impl=path)
        loss.backward()
        outs.append((loss, stats, h.grad, w.grad))
    (a, sa, ha, wa), (b, sb, hb, wb) = outs
    assert_close(b, a, what="loss")
    assert_close(sb["entropy"], sa["entropy"], what="entropy")
    assert_close(hb, ha, what="dhidden", grad=True)
    assert_close(wb, wa, what="dweight", grad=True)


# --------------------------------------------------------------------------
# 3. Per-token inputs on the loss tokens only ([M]) everywhere
# --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_loss_token_inputs_equal_packed_ones(impl):
    ready(impl)
    t = _token_problem(seed=2)
    m = t["mask"]
    outs = []
    for gathered in (False, True):
        pick = (lambda v: v[m]) if gathered else (lambda v: v)
        x = leaf(t["logp"])
        loss, stats = _loss(impl, t, logp=x, old=pick(t["old"]), ref=pick(t["ref"]), token_weights=pick(t["weights"]))
        loss.backward()
        outs.append((loss, stats, x.grad))
    assert_close(outs[1][0], outs[0][0], what="loss")
    assert_close(outs[1][2], outs[0][2], what="dlogp", grad=True)
    for k in outs[0][1]:
        assert_close(outs[1][1][k], outs[0][1][k], what=k)


# --------------------------------------------------------------------------
# Validation at the door: one ValueError naming the argument
# --------------------------------------------------------------------------
def _bad_calls():
    t = _token_problem()
    n = t["logp"].numel()
    m = int(t["mask"].sum())
    p = packed_problem()
    fl = dict(hidden=p["hidden"], weight=p["weight"], targets=p["targets"], advantages=p["advantages"],
              loss_mask=p["loss_mask"], cu_seqlens=p["cu_seqlens"])
    g = lambda **kw: (lambda: rcgrpo_kernels.grpo_loss(**{**dict(logp=t["logp"], old_logp=t["old"], ref_logp=t["ref"],  # noqa: E731
                                                          advantages=t["adv"], loss_mask=t["mask"],
                                                          cu_seqlens=t["cu"]), **kw}))
    f = lambda **kw: (lambda: rcgrpo_kernels.fused_linear_grpo_loss(**{**fl, **kw}))  # noqa: E731
    bad_cu = t["cu"].clone()
    bad_cu[2] = bad_cu[1] - 1
    yield "old_logp has 5 elements", g(old_logp=torch.zeros(5, device=DEVICE))
    yield f"ref_logp has {m + 1} elements, expected {n} or {m}", g(ref_logp=torch.zeros(m + 1, device=DEVICE))
    yield "token_weights has 3 elements", g(token_weights=torch.zeros(3, device=DEVICE))
    yield "logp must be 1-D", g(logp=t["logp"][:, None])
    yield "logp must be a floating-point tensor", g(logp=t["logp"].long())
    yield "loss_mask has", g(loss_mask=t["mask"][:-1])
    yield "cu_seqlens must be an integer tensor", g(cu_seqlens=t["cu"].float())
    yield "cu_seqlens must start at 0, never decrease", g(cu_seqlens=bad_cu)
    yield "cu_seqlens must start at 0", g(cu_seqlens=t["cu"] + 1)
    yield "advantages has 2 elements, expected S=6", g(advantages=torch.zeros(2, device=DEVICE))
    yield "eps_low must be a finite number >= 0", g(eps_low=-0.1)
    yield "eps_high must be a finite number >= 0", g(eps_high=NAN)
    yield "beta must be a finite number >= 0", g(beta=INF)
    yield "beta != 0 needs ref_logp", g(beta=0.1, ref_logp=None)
    yield "clip_ratio_c must be a finite number > 1", g(clip_ratio_c=1.0)
    yield "kl_estimator must be one of", g(kl_estimator="k4")
    yield "log_ratio_clamp must be a finite number > 0", g(log_ratio_clamp=0)
    yield "kl_clamp must be a finite number > 0", g(kl_clamp=-1)
    yield "loss_type must be one of", g(loss_type="sapo")
    yield "max_tokens must be a finite number > 0", g(loss_type="dr_grpo", max_tokens=0)
    yield r"hidden \[N, H\] and weight \[V, H\] must share H", f(weight=p["weight"][:, :5])
    yield "bias has 3 elements, expected 75", f(bias=torch.zeros(3, device=DEVICE))
    yield "targets must be an integer tensor", f(targets=p["targets"].float())
    yield "temperature must be a finite number > 0", f(temperature=0.0)
    yield r"targets must be token ids in \[0, 75\) where they are read, got values in \[-100",\
        f(targets=torch.where(p["loss_mask"], torch.full_like(p["targets"], -100), p["targets"]))
    yield "targets must be token ids in", lambda: rcgrpo_kernels.token_logprobs(torch.zeros(3, 7, device=DEVICE),
                                                                         torch.tensor([0, 7, 1], device=DEVICE))
    yield "targets must be token ids in", lambda: rcgrpo_kernels.fused_linear_logprobs(
        p["hidden"], p["weight"], torch.full_like(p["targets"], 75))
    yield "logits must be 2-D", lambda: rcgrpo_kernels.token_logprobs(torch.zeros(3, device=DEVICE),
                                                              torch.zeros(3, dtype=torch.long, device=DEVICE))
    yield "weight must be a floating-point tensor", lambda: rcgrpo_kernels.fused_linear_logprobs(
        p["hidden"], p["weight"].long(), p["targets"])
    ids = torch.arange(6, device=DEVICE)
    yield "input_ids must be a 1-D integer tensor", lambda: rcgrpo_kernels.next_token_targets(
        ids.float(), torch.ones(6, dtype=torch.bool, device=DEVICE), cu_of([6]))
    yield "cu_seqlens must run from 0 to N=6", lambda: rcgrpo_kernels.next_token_targets(
        ids, torch.ones(6, dtype=torch.bool, device=DEVICE), cu_of([5]))


@pytest.mark.parametrize("message,call", list(_bad_calls()), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_are_one_line_value_errors(message, call):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_an_ignore_index_off_the_loss_tokens_is_fine():
    """The fused loss reads targets only where loss_mask is True: -100 (HF's
    ignore index) elsewhere is accepted and changes nothing."""
    p = packed_problem(seed=8)
    targets = torch.where(p["loss_mask"], p["targets"], torch.full_like(p["targets"], -100))
    args = (p["hidden"], p["weight"])
    rest = (p["advantages"], p["loss_mask"], p["cu_seqlens"])
    a, _ = rcgrpo_kernels.fused_linear_grpo_loss(*args, p["targets"], *rest)
    b, _ = rcgrpo_kernels.fused_linear_grpo_loss(*args, targets, *rest)
    assert a.item() == b.item()


# --------------------------------------------------------------------------
# 5. Small sharp edges
# --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_a_strided_bias_is_read_correctly(impl):
    ready(impl)
    p = packed_problem(seed=9, bias=True)
    strided = torch.stack([p["bias"], torch.full_like(p["bias"], 100.0)], 1)[:, 0]  # stride 2
    assert strided.stride(0) == 2
    outs = []
    for bias in (p["bias"], strided):
        b = leaf(bias)
        h = leaf(p["hidden"])
        loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(h, p["weight"], p["targets"], p["advantages"], p["loss_mask"],
                                                 p["cu_seqlens"], bias=b, impl=impl)
        loss.backward()
        lp = rcgrpo_kernels.fused_linear_logprobs(p["hidden"], p["weight"], p["targets"], bias=bias, impl=impl)
        outs.append((loss, h.grad, b.grad, lp))
    for a, b, what in zip(outs[0], outs[1], ("loss", "dhidden", "dbias", "logprobs")):
        assert_close(b, a, what=what, grad=what.startswith("d"))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_minus_inf_log_prob_on_a_loss_token_gives_a_finite_kl_statistic(impl):
    """The statistic clamps the log-ratio to +-20 (as verl does); with beta 0
    the loss and its gradient stay finite too."""
    ready(impl)
    t = _token_problem(seed=3)
    i = _first_loss_token(t["mask"])
    logp = t["logp"].clone()
    logp[i] = -INF
    x = leaf(logp)
    loss, stats = _loss(impl, t, logp=x, old=None, beta=0.0)
    assert torch.isfinite(stats["kl"]) and stats["kl"].item() > 1e6
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


# --------------------------------------------------------------------------
# The edge grid
# --------------------------------------------------------------------------
EDGE_CASES = {
    # name: (seqlens, loss fraction)
    "one-token sequences": ((1, 2, 1, 1, 3), 1.0),
    "a 70,000-token sequence": ((70_000, 4), 0.003),
}


# Triton's interpreter on a CPU takes ~3 s over the 70,000 tokens: that pair is slow.
@pytest.mark.parametrize("impl, case", [
    pytest.param(impl, case, id=f"{case}-{impl}",
                 marks=[pytest.mark.slow] if (impl, case) == ("triton", "a 70,000-token sequence") else [])
    for case in EDGE_CASES for impl in IMPLS])
def test_edge_batches_match_the_reference(impl, case):
    ready(impl)
    seqlens, frac = EDGE_CASES[case]
    p = packed_problem(seqlens=seqlens, hdim=16, vocab=75, frac=frac, seed=10)
    assert p["loss_mask"].any()
    old, ref = old_ref_for(p)
    outs = []
    for path in ("reference", impl):
        h, w = leaf(p["hidden"]), leaf(p["weight"])
        loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(h, w, p["targets"], p["advantages"], p["loss_mask"],
                                                     p["cu_seqlens"], old, ref, eps_low=0.1, eps_high=0.28,
                                                     beta=0.04, clip_ratio_c=1.5, impl=path)
        loss.backward()
        # grpo_loss over all N positions (the packed search for every token),
        # fed log-probs of the loss rows only (the interpreter projects 70,000 rows slowly)
        m = p["loss_mask"]
        lp = torch.zeros(m.numel(), device=DEVICE).index_put(
            (m.nonzero().reshape(-1),), rcgrpo_kernels.fused_linear_logprobs(p["hidden"][m], p["weight"], p["targets"][m],
                                                                      impl=path))
        t_loss, _ = rcgrpo_kernels.grpo_loss(lp, old, ref, p["advantages"], m, p["cu_seqlens"], beta=0.04, impl=path)
        outs.append((loss, stats, h.grad, w.grad, t_loss))
    (a, sa, ha, wa, ta), (b, sb, hb, wb, tb) = outs
    assert_close(b, a, what="loss")
    assert_close(tb, ta, what="grpo_loss")
    for k in sa:
        assert_close(sb[k], sa[k], what=k)
    assert_close(hb, ha, what="dhidden", grad=True)
    assert_close(wb, wa, what="dweight", grad=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_groups_of_one_and_constant_groups_contribute_no_policy_gradient(impl):
    """Advantages from group_advantages (a group of one, a constant group, a
    spread group) into the fused loss, beta 0: only the spread group's tokens
    get a gradient."""
    ready(impl)
    seqlens = (6, 5, 7, 4, 6)
    p = packed_problem(seqlens=seqlens, seed=11)
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0], device=DEVICE)
    groups = torch.tensor([0, 1, 1, 2, 2], device=DEVICE)  # one, spread, constant... group 0 of one
    rewards[1] = 1.0  # group 1 = {1.0, 0.0}: spread
    adv = rcgrpo_kernels.group_advantages(rewards, groups, impl=impl)
    assert adv[0] == 0 and (adv[3:] == 0).all() and (adv[1:3] != 0).all()
    h = leaf(p["hidden"])
    loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(h, p["weight"], p["targets"], adv, p["loss_mask"], p["cu_seqlens"],
                                             impl=impl)
    loss.backward()
    cu = p["cu_seqlens"].tolist()
    silent = torch.zeros(sum(seqlens), dtype=torch.bool, device=DEVICE)
    for s in (0, 3, 4):
        silent[cu[s]:cu[s + 1]] = True
    assert (h.grad[silent] == 0).all()
    assert (h.grad[~silent & p["loss_mask"]] != 0).any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("needs", ["", "h", "w", "b", "hw", "hb", "wb", "hwb"])
def test_every_combination_of_inputs_requiring_grad(impl, needs):
    ready(impl)
    p = packed_problem(seed=12, bias=True)
    old, ref = old_ref_for(p)

    def run(path):
        h, w, b = (leaf(p[k]) if k[0] in needs else p[k] for k in ("hidden", "weight", "bias"))
        loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(h, w, p["targets"], p["advantages"], p["loss_mask"],
                                                 p["cu_seqlens"], old, ref, beta=0.04, bias=b, impl=path)
        assert loss.requires_grad == bool(needs)
        if needs:
            loss.backward()
        lp = rcgrpo_kernels.fused_linear_logprobs(*(leaf(p[k]) if k[0] in needs else p[k] for k in ("hidden", "weight")),
                                           p["targets"], bias=p["bias"], impl=path)
        grads = [t.grad for t in (h, w, b) if t.requires_grad]
        return loss, grads, lp

    (a, ga, la), (b, gb, lb) = run("reference"), run(impl)
    assert_close(b, a, what="loss")
    assert_close(lb, la, what="logprobs")
    assert len(ga) == len(gb) == len(needs)
    for x, y, k in zip(gb, ga, needs):
        assert_close(x, y, what=f"d{k}", grad=True)


@pytest.mark.slow
def test_chunked_past_two_to_the_31_logits():
    """M x V > 2^31 projected logits on the chunked path (small H): the loss
    and gradients equal the reference's, taken slice by slice through the
    chain rule (d loss / d logp from the reference loss, then each slice's
    log-probs backward), so that no [N, V] tensor exists anywhere."""
    gen = torch.Generator().manual_seed(0)
    n, v, hdim = 33_000, 65_536, 4
    seqlens = [n // 3, n // 3, n - 2 * (n // 3)]
    cu = cu_of(seqlens, "cpu")
    mask = loss_mask_for(seqlens, frac=1.0, device="cpu")  # every row but the sequences' last ones
    assert int(mask.sum()) * v > 2**31
    hidden = torch.randn(n, hdim, generator=gen)
    weight = 0.3 * torch.randn(v, hdim, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    adv = torch.tensor([1.0, -0.5, 0.25])
    h, w = leaf(hidden), leaf(weight)
    got, _ = rcgrpo_kernels.fused_linear_grpo_loss(h, w, targets, adv, mask, cu, impl="chunked")
    got.backward()

    rows = mask.nonzero().reshape(-1)
    hr, wr = leaf(hidden), leaf(weight)
    # On-policy with beta 0 the loss and d loss / d logp do not depend on the
    # log-probs' values (ratio 1): the reference loss of any logp gives both.
    x = leaf(torch.zeros(n))
    want, _ = rcgrpo_kernels.grpo_loss(x, None, None, adv, mask, cu, impl="reference")
    want.backward()
    upstream = x.grad[rows]
    for r, g in zip(rows.split(4096), upstream.split(4096)):
        (rcgrpo_kernels.fused_linear_logprobs(hr[r], wr, targets[r], impl="reference") * g).sum().backward()
    assert_close(got, want, what="loss")
    assert_close(h.grad, hr.grad, what="dhidden", grad=True)
    # dweight sums 33,000 rows in fp32, in 129 chunks here and 5 slices there:
    # rounding alone leaves ~1e-5 of its scale between them.
    scale = wr.grad.abs().max().item()
    assert (w.grad - wr.grad).abs().max().item() <= 1e-4 * scale
