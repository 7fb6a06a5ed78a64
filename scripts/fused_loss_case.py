"""The fused-linear GRPO loss case shared by ``scripts/gpu_check.py`` and the
benchmarks (``benchmarks/test_kernels.py``, ``benchmarks/fused_loss_case.py``):
its inputs and a forward+backward callable for each path, ours and Liger's.
"""
from __future__ import annotations

import math

import torch

SEQ = 512
LOSS = dict(eps_low=0.2, eps_high=0.28, beta=0.04, loss_type="grpo")


def make_inputs(hdim, vocab, n, frac, dtype, device):
    torch.manual_seed(0)
    s = n // SEQ
    hidden = torch.randn(n, hdim, device=device, dtype=torch.float32).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hdim, device=device) * hdim**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=device)
    cu = torch.arange(0, n + 1, SEQ, device=device, dtype=torch.int32)
    # the completion is the tail of each sequence (prompt and tool output first)
    in_seq = torch.arange(n, device=device) % SEQ
    mask = in_seq >= round(SEQ * (1 - frac))
    adv = torch.randn(s, device=device)
    # logits ~ N(0, 1), so log-probs sit near -log V - 0.5: ratios stay near 1
    old = -math.log(vocab) - 0.5 + 0.1 * torch.randn(n, device=device)
    ref = old + 0.05 * torch.randn(n, device=device)
    return dict(hidden=hidden, weight=weight, targets=targets, cu=cu, mask=mask, adv=adv, old=old, ref=ref, s=s)


def make_fn(path, x, compiled=False):
    """A zero-argument forward+backward of one path over inputs ``x``."""
    import rcgrpo_kernels

    def clear():
        x["hidden"].grad = None
        x["weight"].grad = None

    if path in ("reference", "chunked", "triton"):
        def run():
            clear()
            loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(
                x["hidden"], x["weight"], x["targets"], x["adv"], x["mask"], x["cu"], x["old"], x["ref"],
                impl=path, **LOSS)
            loss.backward()
            return loss
        return run

    s, hdim = x["s"], x["hidden"].shape[1]
    ids = x["targets"].view(s, SEQ)
    mask = x["mask"].view(s, SEQ).float()
    old = x["old"].view(s, SEQ)
    ref = x["ref"].view(s, SEQ)
    if path in ("liger", "liger_completion"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # "liger": every position of [S, SEQ, H]; "liger_completion": each
        # sequence's completion tail only, which is how TRL calls it
        # (logits_to_keep), so prompt rows are never projected
        keep = int(mask[0].sum()) if path == "liger_completion" else SEQ
        sl = slice(SEQ - keep, SEQ)
        loss_fn = LigerFusedLinearGRPOLoss(beta=LOSS["beta"], compiled=compiled, chunk_size=1,
                                           epsilon_low=LOSS["eps_low"], epsilon_high=LOSS["eps_high"],
                                           loss_type=LOSS["loss_type"], temperature=1.0)

        def run():
            clear()
            loss, _ = loss_fn(x["hidden"].view(s, SEQ, hdim)[:, sl], x["weight"], ids[:, sl], mask[:, sl],
                              x["adv"], ref_per_token_logps=ref[:, sl], old_per_token_logps=old[:, sl])
            loss.backward()
            return loss
        return run
    if path == "liger_triton":
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        # triton_grpo_loss reads logits [B, L+1, V] (the last position is a
        # shifted-out one): append one position per sequence.
        def run():
            clear()
            h = x["hidden"].view(s, SEQ, hdim)
            h = torch.cat([h, h[:, -1:]], dim=1)
            logits = h @ x["weight"].t()
            loss, _ = triton_grpo_loss(logits, old, ref, ids, x["adv"], mask, temperature=1.0,
                                       beta=LOSS["beta"], eps_low=LOSS["eps_low"], eps_high=LOSS["eps_high"],
                                       loss_type=LOSS["loss_type"], reduce=True)
            loss.backward()
            return loss
        return run
    raise ValueError(path)
