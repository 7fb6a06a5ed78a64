"""What the mask path's attention costs on CPU: torch's scaled-dot-product
attention with an [M, M] mask (how ``rcgrpo.attention`` keeps packed
sequences, and prefix-shared tails, apart without flash-attn) against the
same sequences attended one by one with ``is_causal``.

The mask path computes every query-key pair of the micro-batch, masked or
not, so packing k unrelated sequences into one pass costs about k times the
attention of those sequences apart; prefix sharing's win is in the tokens
the decoder no longer computes (linear layers and attention both), not in
the mask. The ratio printed here is what a block-sparse attention on the
mask path would save.

Run: pytest benchmarks/test_packed_attention.py --benchmark-only -s
"""
import time

import pytest
import torch
import torch.nn.functional as F

from rcgrpo.attention import additive_mask, block_causal_mask

HEADS, HEAD_DIM = 9, 64  # SmolLM2-135M's attention (after repeat_kv)


def _fwd_bwd(n_tokens: int, mask, rounds: int = 3) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n_tokens, HEAD_DIM, generator=g).requires_grad_() for _ in range(3))
    start = time.perf_counter()
    for _ in range(rounds):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out.sum().backward()
    return (time.perf_counter() - start) / rounds


@pytest.mark.parametrize("seqs", [1, 2, 4, 8])
def test_masked_pass_against_separate_passes(benchmark, seqs):
    n = 4096
    cu = torch.arange(0, n + 1, n // seqs, dtype=torch.int32)
    mask = additive_mask(block_causal_mask(cu), torch.float32)

    def both():
        return {"masked_s": _fwd_bwd(n, mask), "separate_s": seqs * _fwd_bwd(n // seqs, None)}

    result = benchmark.pedantic(both, rounds=1, iterations=1)
    result["ratio"] = result["masked_s"] / result["separate_s"]
    benchmark.extra_info.update(result)
    print(f"\n{seqs} sequences in {n} tokens: masked {result['masked_s']:.3f} s, "
          f"apart {result['separate_s']:.3f} s per attention forward + backward ({result['ratio']:.1f}x)")
