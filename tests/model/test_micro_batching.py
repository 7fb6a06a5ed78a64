"""Micro-batches of a packed batch (rcgrpo.model.micro_batching): a
partition within the token budget, balanced, the ones without a loss token
left out on request, each sequence intact."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rcgrpo.model.micro_batching import balance_micro_batches, micro_batch_plan, micro_batches
from rcgrpo.model.packing import pack
from tests.model.test_packing import trajectories


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 600), st.integers(1, 4))
def test_micro_batches_partition_and_respect_budget(lengths, budget, min_bins):
    bins = balance_micro_batches(lengths, budget, min_bins)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert len(bins) >= min(min_bins, len(lengths))
    for b in bins:
        assert b and b == sorted(b)
        load = sum(lengths[i] for i in b)
        assert load <= budget or len(b) == 1  # only a lone oversize sequence exceeds it


def test_micro_batches_are_balanced():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]  # 550 tokens
    bins = balance_micro_batches(lengths, 300)
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(bins) == 2 and loads[1] - loads[0] <= 10


@settings(max_examples=60, deadline=None)
@given(trajectories(max_seqs=8), st.integers(1, 30), st.booleans())
def test_loss_only_leaves_out_exactly_the_micro_batches_without_a_loss_token(trajs, budget, share):
    full = pack(trajs)
    plan = micro_batch_plan(full, budget, share)
    kept = micro_batch_plan(full, budget, share, loss_only=True)
    assert kept == [ix for ix in plan if full.select(ix).num_loss_tokens]
    assert [m.num_loss_tokens for m in micro_batches(full, budget, share, loss_only=True)] == \
        [full.select(ix).num_loss_tokens for ix in kept]


@settings(max_examples=40, deadline=None)
@given(trajectories(max_seqs=8), st.integers(1, 30))
def test_select_keeps_each_sequence_intact(trajs, budget):
    full = pack(trajs)
    full = dataclasses.replace(full, advantages=torch.arange(full.num_seqs, dtype=torch.float32))
    seen = []
    for mb in micro_batches(full, budget, share_prefixes=False):
        assert mb.cu_seqlens.dtype == torch.int32
        for k, s in enumerate(mb.advantages.long().tolist()):
            single = pack([trajs[s]])
            a, b = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
            for name in ("input_ids", "position_ids", "loss_mask", "targets", "engine_logp", "policy_version",
                         "sampled_mask"):
                assert torch.equal(getattr(mb, name)[a:b], getattr(single, name)), name
            assert mb.seq_group[k] == trajs[s].group and mb.rewards[k] == trajs[s].reward
            seen.append(s)
    assert sorted(seen) == list(range(len(trajs)))
