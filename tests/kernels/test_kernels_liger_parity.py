"""Parity with Liger-Kernel's chunked fused-linear GRPO loss (CPU, fp32).

Liger takes a padded [B, T] batch with per-position targets, a completion
mask and per-sequence advantages; we take the same tokens packed. Settings
both support: loss types grpo / bnpo / dapo / dr_grpo (dr_grpo with Liger's
max_completion_length as our max_tokens), old log-probs given or not, k3 KL
to given reference log-probs (Liger computes it only when beta != 0),
eps_low != eps_high, temperature, bias. Liger's grpo mean divides by every
sequence, ours skips sequences without loss tokens, so every sequence here
has at least one loss token.
"""

import pytest
import torch
from kernels_testlib import DEVICE, FAST_IMPLS, IMPLS, assert_close, cu_of, triton_ready

import rcgrpo_kernels
from tests.required import require

liger_grpo = require("liger_kernel.chunked_loss.grpo_loss", "dev")

SEQLENS = [7, 3, 10, 5]
H, V = 16, 53


def _problem(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = len(SEQLENS), max(SEQLENS)
    hidden = torch.randn(b, t, H, generator=g)
    weight = 0.3 * torch.randn(V, H, generator=g)
    bias = 0.5 * torch.randn(V, generator=g)
    ids = torch.randint(0, V, (b, t), generator=g)
    valid = torch.arange(t)[None, :] < torch.tensor(SEQLENS)[:, None]
    mask = valid & (torch.rand(b, t, generator=g) < 0.7)
    mask[:, 0] = True  # every sequence has a loss token (see module docstring)
    adv = torch.randn(b, generator=g)
    with torch.no_grad():
        lp = torch.log_softmax((hidden @ weight.t() + bias) / 0.8, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = lp + 0.3 * torch.randn(b, t, generator=g)
    ref = lp + 0.3 * torch.randn(b, t, generator=g)
    return tuple(x.to(DEVICE) for x in (hidden, weight, bias, ids, valid, mask, adv, old, ref))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta,with_old", [(0.0, True), (0.04, True), (0.04, False)])
def test_matches_liger(impl, loss_type, beta, with_old):
    if impl == "triton":
        triton_ready()
    hidden, weight, bias, ids, valid, mask, adv, old, ref = _problem(seed=len(loss_type) + int(100 * beta))
    max_len = 12
    liger = liger_grpo.LigerFusedLinearGRPOLoss(
        beta=beta, compiled=False, use_ref_model=beta != 0.0, chunk_size=1, epsilon_low=0.15, epsilon_high=0.3,
        loss_type=loss_type, max_completion_length=max_len, temperature=0.8)
    lh, lw, lb = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    l_loss, l_metrics = liger(lh, lw, ids, mask.float(), adv, bias=lb, ref_per_token_logps=ref,
                              old_per_token_logps=old if with_old else None)
    l_loss.backward()

    # the same tokens, packed: drop the padding
    ph = hidden[valid].clone().requires_grad_()
    pw, pb = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(
        ph, pw, ids[valid], adv, mask[valid], cu_of(SEQLENS), old[valid] if with_old else None,
        ref[valid], eps_low=0.15, eps_high=0.3, beta=beta, temperature=0.8, loss_type=loss_type, bias=pb,
        max_tokens=max_len, impl=impl)
    loss.backward()

    assert_close(loss, l_loss, what="loss")
    if beta != 0.0:
        kl_liger, clip_liger = l_metrics
        assert_close(stats["kl"], kl_liger, what="kl")
    else:
        (clip_liger,) = l_metrics
    assert_close(stats["clip_frac"], clip_liger, what="clip_frac")
    assert_close(ph.grad, lh.grad[valid], what="dhidden", grad=True)
    assert_close(pw.grad, lw.grad, what="dweight", grad=True)
    assert_close(pb.grad, lb.grad, what="dbias", grad=True)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_matches_liger_bf16(impl):
    """bf16 inputs: Liger rounds each logits chunk to bf16 before its fp32
    softmax, we keep fp32 accumulators, so agreement is to bf16 precision."""
    if impl == "triton":
        triton_ready()
    hidden, weight, bias, ids, valid, mask, adv, old, ref = _problem(seed=9)
    liger = liger_grpo.LigerFusedLinearGRPOLoss(beta=0.04, compiled=False, chunk_size=1, loss_type="dapo")
    lh, lw = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    l_loss, _ = liger(lh, lw, ids, mask.float(), adv, ref_per_token_logps=ref, old_per_token_logps=old)
    l_loss.backward()
    ph = hidden[valid].bfloat16().requires_grad_()
    pw = weight.bfloat16().requires_grad_()
    loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(ph, pw, ids[valid], adv, mask[valid], cu_of(SEQLENS),
                                             old[valid], ref[valid], beta=0.04, loss_type="dapo", impl=impl)
    loss.backward()
    assert abs(loss.item() - l_loss.item()) <= 2e-2 * max(1.0, abs(l_loss.item()))
    for a, e in ((ph.grad, lh.grad[valid]), (pw.grad, lw.grad)):
        err = (a.float() - e.float()).abs().max().item()
        assert err <= 5e-2 * e.float().abs().max().item()
