"""What the mask path's attention costs on CPU: torch's scaled-dot-product
attention with an [M, M] mask (how ``rcgrpo.model.attention``'s eager path keeps
packed sequences, and prefix-shared tails, apart) against the same sequences
attended one by one with ``is_causal``.

One masked call computes every query-key pair of the micro-batch, masked or
not, so packing k unrelated sequences into one pass costs about k times the
attention of those sequences apart. That ratio is what
tree attention (``rcgrpo.model.tree_attention``, one call per node over the keys
it may see, what a policy's sdpa model runs) saves; ``eager`` still pays it.

Sizes (``benchmarks/scale.py``): quick, 4 sequences in 4,096 tokens; full,
1, 2, 4 and 8 sequences and the same comparison inside the 135M model's
forward + backward; smoke, 2 sequences in 512 tokens and the 135M model on a
tiny batch. Target: apart <= 1.0x the masked call's time wherever there is
more than one sequence (the 1-sequence row is the control).
"""
import time

import pytest
import torch
import torch.nn.functional as F

from benchmarks import scale
from benchmarks.scoreboard import Comparison
from rcgrpo.model.attention import additive_mask, block_causal_mask

HEADS, HEAD_DIM = 9, 64  # SmolLM2-135M's attention (after repeat_kv)
N_TOKENS = scale.pick(smoke=512, quick=4096)
SEQS = scale.pick(smoke=(2,), quick=(4,), full=(1, 2, 4, 8))
# The 135M check: prompt and reply lengths of each of its four groups
MODEL_SIZES = scale.pick(smoke=(64, 8), quick=None, full=(1500, 100))
pytestmark = pytest.mark.benchmark(group="attention on CPU: packed masked call vs per-sequence calls")


def _fwd_bwd(n_tokens: int, mask, rounds: int = 3) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n_tokens, HEAD_DIM, generator=g).requires_grad_() for _ in range(3))
    start = time.perf_counter()
    for _ in range(rounds):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out.sum().backward()
    return (time.perf_counter() - start) / rounds


@pytest.mark.parametrize("seqs", SEQS)
def test_masked_pass_against_separate_passes(benchmark, board, seqs):
    n = N_TOKENS
    cu = torch.arange(0, n + 1, n // seqs, dtype=torch.int32)
    mask = additive_mask(block_causal_mask(cu), torch.float32)

    def both():
        return {"masked_s": _fwd_bwd(n, mask), "separate_s": seqs * _fwd_bwd(n // seqs, None)}

    result = benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    board.record(Comparison(group="attention", name="SDPA fwd+bwd, packed sequences", ours="one call per sequence",
                            peer="one masked call", ours_s=result["separate_s"], peer_s=result["masked_s"],
                            shape=f"cpu fp32 {HEADS} heads x {HEAD_DIM}, {seqs} sequences in {n} tokens",
                            per="attention pass", max_time_ratio=1.0 if seqs > 1 else None))


@pytest.mark.skipif(MODEL_SIZES is None, reason="the 135M model's attention check runs in the full sweep (--full)")
def test_tree_against_one_masked_call_on_the_135m_model(benchmark, board):
    """The 135M model, forward and backward over one micro-batch of four
    prompt groups (a 1,500-token prompt and two 100-token replies each, the
    prompts forwarded once): tree attention against the same forward with one
    masked SDPA call per layer (sdpa outside a policy). Smoke size: 64 and 8."""
    from transformers import AutoModelForCausalLM

    from rcgrpo.model.attention import decoder_hidden_states
    from rcgrpo.model.loading import resolve_model_folder
    from rcgrpo.model.packing import Trajectory, pack
    from rcgrpo.model.policy import TrainablePolicy

    folder = str(resolve_model_folder(None))
    g = torch.Generator().manual_seed(0)
    prompt_len, reply_len = MODEL_SIZES
    trajectories = []
    for group in range(4):
        prompt = torch.randint(0, 40000, (prompt_len,), generator=g).tolist()
        for _ in range(2):
            reply = torch.randint(0, 40000, (reply_len,), generator=g).tolist()
            trajectories.append(Trajectory(prompt + reply, [0] * prompt_len + [1] * reply_len, group=group))
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

    def tree():
        policy = TrainablePolicy(load())  # its sdpa runs under tree attention
        return timed(lambda: policy.lm.hidden_states(batch), policy.model)

    def both():
        return {"masked_s": one_masked_call(), "tree_s": tree()}

    result = benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    board.record(Comparison(group="attention", name="135M fwd+bwd, 4 prompt groups", ours="tree attention (policy)",
                            peer="one masked SDPA call per layer", ours_s=result["tree_s"],
                            peer_s=result["masked_s"], per="forward + backward", max_time_ratio=1.0,
                            shape=f"cpu fp32 135M, {batch.num_tokens} packed tokens, prompts forwarded once"))
