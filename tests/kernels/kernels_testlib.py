"""Shared builders and comparisons for the kernel tests (no test functions here)."""

from __future__ import annotations

import pytest
import torch

from scripts.kernel_tolerance import assert_close  # noqa: F401  (the tests' name for it)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ("reference", "chunked", "triton")
FAST_IMPLS = ("chunked", "triton")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# test_kernels_compile's resource table, for the terminal summary (conftest.py)
COMPILE_TABLE = pytest.StashKey[str]()

# Ragged: an empty sequence, a one-token sequence, and long/short ones.
SEQLENS = (5, 0, 12, 1, 13, 9)


def triton_ready() -> None:
    """Skip when the Triton path cannot run here (CPU without the interpreter:
    a module imported triton kernels before tests/kernels/conftest.py ran)."""
    if DEVICE == "cuda":
        return
    from rcgrpo_kernels.triton.common import interpreting

    if not interpreting():
        pytest.skip("Triton kernels were compiled before TRITON_INTERPRET=1 could be set")


def ready(impl: str) -> None:
    """Skip a Triton case that cannot run here (see ``triton_ready``); other paths always run."""
    if impl == "triton":
        triton_ready()


def cu_of(seqlens, device=DEVICE) -> torch.Tensor:
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def loss_mask_for(seqlens, frac=0.6, seed=0, device=DEVICE) -> torch.Tensor:
    """Random mask that, like a real packed batch, is False on the last token
    of every sequence (it predicts nothing)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(seqlens)
    mask = torch.rand(n, generator=g) < frac
    cu = cu_of(seqlens, "cpu").long()
    ends = cu[1:][cu[1:] > cu[:-1]] - 1
    mask[ends] = False
    return mask.to(device)


def packed_problem(seqlens=SEQLENS, hdim=24, vocab=75, dtype=torch.float32, bias=False, frac=0.6,
                   seed=0, device=DEVICE, mask=None):
    """A small fused-linear GRPO problem; vocab 75 is not a multiple of any block size."""
    g = torch.Generator().manual_seed(seed)
    n, s = sum(seqlens), len(seqlens)
    p = dict(
        hidden=torch.randn(n, hdim, generator=g).to(device, dtype),
        # small weights keep logits O(1): ratios stay near the clip range
        weight=(0.3 * torch.randn(vocab, hdim, generator=g)).to(device, dtype),
        targets=torch.randint(0, vocab, (n,), generator=g).to(device),
        advantages=torch.randn(s, generator=g).to(device),
        loss_mask=loss_mask_for(seqlens, frac, seed, device) if mask is None else mask.to(device),
        cu_seqlens=cu_of(seqlens, device),
        bias=(0.5 * torch.randn(vocab, generator=g)).to(device, dtype) if bias else None,
    )
    return p


def old_ref_for(p, temperature=1.0, spread=0.3, seed=1):
    """old/ref log-probs near the current policy's, so that some ratios fall
    inside and some outside the clip range."""
    import rcgrpo_kernels

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lp = rcgrpo_kernels.fused_linear_logprobs(p["hidden"], p["weight"], p["targets"], temperature, p["bias"],
                                           impl="reference")
    noise = lambda: spread * torch.randn(lp.shape, generator=g).to(lp.device)  # noqa: E731
    return lp + noise(), lp + noise()


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)
