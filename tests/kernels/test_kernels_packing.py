"""The packed-batch contract: next-token alignment, sequence lookup, counts
and reduction weights (what the fast paths share)."""

import torch
from kernels_testlib import cu_of

import rcgrpo_kernels
from rcgrpo_kernels import packing


def test_next_token_targets_alignment():
    ids = torch.tensor([10, 11, 12, 20, 21, 30])
    gen = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool)  # generated tokens
    cu = cu_of([3, 2, 1], "cpu")
    targets, pred = rcgrpo_kernels.next_token_targets(ids, gen, cu)
    assert targets.tolist() == [11, 12, 0, 21, 0, 0]  # last token of each sequence -> 0
    assert pred.tolist() == [True, True, False, True, False, False]
    # an empty sequence in the middle or at the front changes nothing
    t2, p2 = rcgrpo_kernels.next_token_targets(ids, gen, cu_of([0, 3, 0, 2, 1], "cpu"))
    assert t2.tolist() == targets.tolist() and p2.tolist() == pred.tolist()


def test_end_to_end_logp_of_generated_tokens():
    """Position i's row scores input_ids[i+1]: the log-probs the kernels
    return on pred_mask are those of the generated tokens, per sequence."""
    g = torch.Generator().manual_seed(0)
    seqlens = [4, 6, 3]
    n, h, v = sum(seqlens), 8, 19
    ids = torch.randint(0, v, (n,), generator=g)
    gen = torch.rand(n, generator=g) < 0.7
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    cu = cu_of(seqlens, "cpu")
    targets, pred = rcgrpo_kernels.next_token_targets(ids, gen, cu)
    want = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        logits = hidden[a : b - 1] @ weight.t()
        lp = torch.log_softmax(logits, -1).gather(1, ids[a + 1 : b, None]).squeeze(1)
        want.append(lp[gen[a + 1 : b]])
    want = torch.cat(want)
    got = rcgrpo_kernels.fused_linear_logprobs(hidden, weight, targets)[pred]
    torch.testing.assert_close(got, want)
    # and the loss sees exactly those tokens: bnpo with ratio 1 is -mean(A)
    adv = torch.tensor([1.0, 2.0, 4.0])
    loss, _ = rcgrpo_kernels.fused_linear_grpo_loss(hidden, weight, targets, adv, pred, cu, loss_type="bnpo")
    seq = packing.sequence_ids(torch.nonzero(pred).reshape(-1), cu)
    assert loss.item() == -adv[seq].mean().item()


def test_sequence_ids_and_counts():
    cu = cu_of([2, 0, 3, 1], "cpu")
    pos = torch.arange(6)
    assert packing.sequence_ids(pos, cu).tolist() == [0, 0, 2, 2, 2, 3]
    mask = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool)
    assert packing.loss_token_counts(mask, cu).tolist() == [1, 0, 2, 0]
