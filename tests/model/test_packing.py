"""Packed batches (rcgrpo.model.packing): layout invariants, the weights
that make micro-batches add up to the full batch's loss, informative groups
and loss normalisers. Micro-batching itself: test_micro_batching.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rcgrpo_kernels
from rcgrpo.model.micro_batching import micro_batches
from rcgrpo.model.packing import (
    PackedBatch,
    Trajectory,
    accumulation_weight,
    informative_sequences,
    loss_normaliser,
    pack,
)


@st.composite
def trajectories(draw, max_seqs=6, max_len=12):
    n_seqs = draw(st.integers(1, max_seqs))
    out = []
    for s in range(n_seqs):
        n = draw(st.integers(1, max_len))
        ids = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        lp = draw(st.lists(st.floats(-20, 0, allow_nan=False), min_size=n, max_size=n))
        out.append(Trajectory(ids, mask, group=s // 2, reward=float(s % 2), logprobs=lp,
                              versions=[s + 3] * n))
    return out


@settings(max_examples=150, deadline=None)
@given(trajectories())
def test_pack_invariants(trajs):
    b = pack(trajs)
    lens = [len(t) for t in trajs]
    n = sum(lens)
    assert b.num_tokens == n and b.num_seqs == len(trajs) and b.seq_lens == lens
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist()[0] == 0 and b.cu_seqlens[-1] == n
    assert b.input_ids.tolist() == [x for t in trajs for x in t.token_ids]
    assert b.position_ids.tolist() == [p for L in lens for p in range(L)]
    assert b.sampled_mask.tolist() == [bool(m) for t in trajs for m in t.sampled_mask]
    assert b.loss_mask.dtype == torch.bool and b.targets.dtype == torch.long
    i = 0
    for t in trajs:
        for j in range(len(t)):
            if j + 1 < len(t):
                assert b.targets[i] == t.token_ids[j + 1]
                assert bool(b.loss_mask[i]) == bool(t.sampled_mask[j + 1])
                if t.sampled_mask[j + 1]:
                    assert b.engine_logp[i].item() == pytest.approx(t.logprobs[j + 1])
                    assert b.policy_version[i] == t.versions[j + 1]
                else:
                    assert b.engine_logp[i] == 0 and b.policy_version[i] == -1
            else:  # last token of a sequence: no target
                assert not b.loss_mask[i] and b.targets[i] == 0 and b.engine_logp[i] == 0
                assert b.policy_version[i] == -1
            i += 1
    assert b.old_logp is None  # the trainer's to fill
    assert b.seq_group.tolist() == [t.group for t in trajs]
    assert b.rewards.tolist() == [t.reward for t in trajs]
    assert b.ref_logp is None


@settings(max_examples=60, deadline=None)
@given(trajectories())
def test_pack_agrees_with_kernels_alignment(trajs):
    """The kernels derive (targets, mask) from the unshifted mask: same answer."""
    from rcgrpo_kernels import packing

    b = pack(trajs)
    targets, pred_mask = packing.next_token_targets(b.input_ids, b.sampled_mask, b.cu_seqlens)
    assert torch.equal(pred_mask, b.loss_mask)
    assert torch.equal(targets, b.targets)


def test_logprobs_given_per_sampled_token():
    full = Trajectory([1, 2, 3, 4], [0, 1, 0, 1], logprobs=[9.0, -1.0, 9.0, -2.0])
    gathered = dataclasses.replace(full, logprobs=[-1.0, -2.0], ref_logprobs=[-1.5, -2.5])
    a, b = pack([full]), pack([gathered])
    assert torch.equal(a.engine_logp, b.engine_logp)
    assert a.engine_logp.tolist() == [-1.0, 0.0, -2.0, 0.0]
    assert b.ref_logp.tolist() == [-1.5, 0.0, -2.5, 0.0]


@pytest.mark.parametrize(
    "trajs, msg",
    [
        ([], "at least one"),
        ([Trajectory([], [])], "empty"),
        ([Trajectory([1, 2], [1])], "sampled_mask"),
        ([Trajectory([1, 2], [0, 1], logprobs=[1.0, 2.0, 3.0])], "logprobs"),
        ([Trajectory([1, 2], [0, 1], logprobs=[-1.0]), Trajectory([3], [0])], "some trajectories"),
        ([Trajectory([1, -2], [0, 1])], "negative"),
        ([Trajectory([1, 2], [0, 1], versions=[0, 1]), Trajectory([3], [0])], "versions given for some"),
    ],
)
def test_pack_rejects_bad_input(trajs, msg):
    with pytest.raises(ValueError, match=msg):
        pack(trajs)


@pytest.mark.parametrize("loss_type", list(rcgrpo_kernels.LOSS_TYPES))  # the sums included (a weight of 1 per part)
def test_accumulation_weights_reproduce_full_batch_loss(loss_type):
    from rcgrpo_kernels import reference as ref

    g = torch.Generator().manual_seed(0)
    trajs = []
    for s in range(7):
        n = int(torch.randint(3, 15, (1,), generator=g))
        mask = (torch.rand(n, generator=g) > 0.4).long().tolist()
        trajs.append(Trajectory(list(range(n)), mask, group=s // 3, reward=float(s % 2)))
    trajs.append(Trajectory([1, 2, 3], [0, 0, 0], group=9))  # no loss tokens at all
    full = pack(trajs)
    full = dataclasses.replace(full, advantages=torch.randn(full.num_seqs, generator=g))
    logp = -torch.rand(full.num_tokens, generator=g)
    full_logp = dict(zip(range(full.num_tokens), logp))  # token index -> value

    def loss_of(b: PackedBatch, lp):
        kw = {"max_tokens": 20.0} if rcgrpo_kernels.get_loss_type(loss_type).scaled_by_max_tokens else {}
        loss, _ = ref.grpo_loss(lp, lp + 0.05, None, b.advantages, b.loss_mask, b.cu_seqlens, loss_type=loss_type, **kw)
        return loss

    expected = loss_of(full, logp)
    # Tag each token with its packed index to find its logp after re-packing.
    tagged = dataclasses.replace(full, old_logp=torch.arange(full.num_tokens, dtype=torch.float32))
    total = 0.0
    for mb in micro_batches(tagged, 25, share_prefixes=False):
        lp = torch.stack([full_logp[int(i)] for i in mb.old_logp])
        total += accumulation_weight(mb, full, loss_type) * loss_of(mb, lp)
    assert float(total) == pytest.approx(float(expected), abs=1e-6)


def _mixed_groups() -> PackedBatch:
    """Three groups: 0 informative (rewards 1, 0), 1 zero-variance (0, 0),
    2 informative (0, 1, 1); one sequence of group 2 has no loss token."""
    T = Trajectory
    return pack([
        T([5, 6, 7, 8], [0, 1, 1, 0], group=0, reward=1.0),        # 2 loss tokens (targets 6, 7)
        T([5, 6, 7], [0, 1, 1], group=0, reward=0.0),              # 2
        T([5, 6, 7, 8, 9], [0, 1, 1, 1, 1], group=1, reward=0.0),  # 4
        T([5, 6], [0, 1], group=1, reward=0.0),                    # 1
        T([5, 6, 7], [0, 0, 1], group=2, reward=0.0),              # 1
        T([5, 6, 7], [0, 0, 0], group=2, reward=1.0),              # 0
        T([5, 6, 7, 8], [0, 1, 0, 1], group=2, reward=1.0),        # 2
    ])


def test_informative_sequences():
    assert informative_sequences(_mixed_groups()).tolist() == [True, True, False, False, True, True, True]


@pytest.mark.parametrize("loss_type, everyone, informative", [
    ("grpo", 6, 4),      # sequences with loss tokens: all but #5 / of those, groups 0 and 2
    ("bnpo", 12, 7),     # loss tokens: 2+2+4+1+1+0+2 / 2+2+1+0+2
    ("dapo", 12, 7),
    ("dr_grpo", 7, 5),   # sequences / sequences of groups 0 and 2
])
def test_loss_normaliser_with_and_without_informative_counting(loss_type, everyone, informative):
    b = _mixed_groups()
    assert loss_normaliser(b, loss_type) == everyone
    assert loss_normaliser(b, loss_type, informative_only=True) == informative
    # The normaliser of the informative groups alone is the informative-only count.
    keep = torch.nonzero(informative_sequences(b)).reshape(-1).tolist()
    assert loss_normaliser(b.select(keep), loss_type) == informative
