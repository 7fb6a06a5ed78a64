"""What the mask path's attention costs on CPU: torch's scaled-dot-product
attention with an [M, M] mask (how ``rcgrpo.attention`` keeps packed
sequences, and prefix-shared tails, apart without flash-attn) against the
same sequences attended one by one with ``is_causal``.

One masked call computes every query-key pair of the micro-batch, masked or
not, so packing k unrelated sequences into one pass costs about k times the
attention of those sequences apart. That ratio is what
``rcgrpo.attention.SEGMENT_SDPA`` (one call per segment, what a policy's
sdpa model runs) saves; ``eager`` still pays it.

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


def test_segments_against_one_masked_call_on_the_135m_model(benchmark):
    """The 135M model, forward and backward over one micro-batch of four
    prompt groups (a 1,500-token prompt and two 100-token replies each, the
    prompts forwarded once): SEGMENT_SDPA against the same forward with one
    masked SDPA call per layer (sdpa outside a policy)."""
    from transformers import AutoModelForCausalLM

    from rcgrpo.attention import decoder_hidden_states
    from rcgrpo.batch import Trajectory, pack
    from rcgrpo.models import resolve_model_folder
    from rcgrpo.policy import TrainablePolicy

    folder = str(resolve_model_folder(None))
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for group in range(4):
        prompt = torch.randint(0, 40000, (1500,), generator=g).tolist()
        for _ in range(2):
            reply = torch.randint(0, 40000, (100,), generator=g).tolist()
            trajectories.append(Trajectory(prompt + reply, [0] * 1500 + [1] * 100, group=group))
    batch = pack(trajectories)

    def timed(hidden_fn, model):
        start = time.perf_counter()
        hidden = hidden_fn()
        (hidden * torch.linspace(0, 1, hidden.numel()).reshape(hidden.shape)).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")

    def one_masked_call():
        model = load()  # plain sdpa: decoder_hidden_states passes the [M, M] mask
        return timed(lambda: decoder_hidden_states(model.model, model.config, torch.float32, batch), model)

    def segments():
        policy = TrainablePolicy(load())  # its sdpa runs as SEGMENT_SDPA
        return timed(lambda: policy.lm.hidden_states(batch), policy.model)

    def both():
        return {"masked_s": one_masked_call(), "segments_s": segments()}

    result = benchmark.pedantic(both, rounds=1, iterations=1)
    result["ratio"] = result["masked_s"] / result["segments_s"]
    benchmark.extra_info.update(result)
    print(f"\n135M, {batch.num_tokens} packed tokens in 4 groups: one masked call {result['masked_s']:.1f} s, "
          f"segments {result['segments_s']:.1f} s ({result['ratio']:.1f}x)")
