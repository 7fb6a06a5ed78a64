"""Prefix sharing (rcgrpo.model.prefix_sharing): the layout against a brute-force
reading of what each token may see, the forward and backward on a real
transformers model against separate forwards, and the micro-batch plan."""
from __future__ import annotations

import random

import pytest
import torch

from rcgrpo.model.micro_batching import balance_micro_batches, micro_batch_plan
from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.model.prefix_sharing import MIN_SHARED_TOKENS, shared_prefix_layout


def saved_tokens(layout) -> int:
    """Tokens the layout does not forward: the sequences' total less the forwarded rows."""
    return int(layout.expand.numel()) - layout.num_forwarded

def _rand(n, g):
    return torch.randint(0, 100, (n,), generator=g).tolist()


def bfcl_shaped(seed=0, groups=3, group_size=3, preamble=40, docs=60, tail=(5, 20)):
    """Trajectories shaped like an RC-GRPO step: a preamble every group shares,
    each group's own docs, a reward token (two kinds) and sampled tails."""
    g = torch.Generator().manual_seed(seed)
    pre = _rand(preamble, g)
    out = []
    for k in range(groups):
        prompt = pre + _rand(docs, g)
        for i in range(group_size):
            token = [101 + (i % 2)]  # two reward tokens
            reply = _rand(int(torch.randint(tail[0], tail[1], (1,), generator=g)), g)
            ids = prompt + token + [7, 8] + reply
            out.append(Trajectory(ids, [0] * (len(ids) - len(reply)) + [1] * len(reply), group=k,
                                  reward=float((i + k) % 2)))
    return out


def visible_by_definition(batch, layout):
    """[M, M] bool from first principles: forwarded row q (token t of sequence
    s) may see row r iff r holds one of s's tokens 0..t."""
    cu = batch.cu_seqlens.tolist()
    m = layout.num_forwarded
    kept = set(layout.keep.tolist())
    owner = {}  # forwarded row -> (sequence, position) of the packed token it was forwarded for
    for s in range(batch.num_seqs):
        for p in range(cu[s], cu[s + 1]):
            if p in kept:
                owner[int(layout.expand[p])] = (s, p - cu[s])
    expect = torch.zeros(m, m, dtype=torch.bool)
    for q, (s, t) in owner.items():
        for j in range(t + 1):
            expect[q, int(layout.expand[cu[s] + j])] = True
    return expect


def test_every_token_reads_its_own_token_at_its_own_position():
    batch = pack(bfcl_shaped())
    lay = shared_prefix_layout(batch)
    ids, pos = batch.input_ids[lay.keep], batch.position_ids[lay.keep]
    assert torch.equal(ids[lay.expand], batch.input_ids)
    assert torch.equal(pos[lay.expand], batch.position_ids)
    # The preamble once, each group's docs once, each reward token's first sequence up to its reply.
    assert lay.num_forwarded < batch.num_tokens / 2


def test_mask_is_what_each_token_may_see():
    batch = pack(bfcl_shaped(seed=1, groups=3, group_size=4))
    lay = shared_prefix_layout(batch)
    mask = lay.attention_mask(batch.position_ids[lay.keep])[0, 0]
    assert torch.equal(mask, visible_by_definition(batch, lay))


def test_tree_levels_preamble_group_and_reward_token():
    """Group 1's second sequence continues group 1's first (docs shared), not
    group 0's (preamble only); the third (same reward token as the first)
    shares past the token."""
    trajs = bfcl_shaped(seed=2, groups=2, group_size=3, preamble=40, docs=60)
    batch = pack(trajs)
    lay = shared_prefix_layout(batch)
    n = [len(t) for t in trajs]
    reply = [sum(t.sampled_mask) for t in trajs]
    assert lay.seq_forwarded[0] == n[0]  # the first root
    assert lay.seq_forwarded[1] == 3 + reply[1]  # other token: from it on
    assert lay.seq_forwarded[2] == reply[2]  # same token as the first: only its reply
    assert lay.seq_forwarded[3] == n[3] - 40  # a new group: all but the preamble
    assert lay.seq_forwarded[4] == 3 + reply[4]
    assert lay.seq_root == (0,) * 6


def test_short_common_prefixes_and_shifted_positions_are_not_shared():
    g = torch.Generator().manual_seed(3)
    a = _rand(50, g)
    b = a[:MIN_SHARED_TOKENS - 1] + _rand(30, g)
    batch = pack([Trajectory(a, [0] * 50), Trajectory(b, [0] * len(b))])
    assert saved_tokens(shared_prefix_layout(batch)) == 0
    # Same tokens at other positions are other rows.
    shifted = pack([Trajectory(a, [0] * 50), Trajectory(a, [0] * 50)])
    shifted.position_ids[50:] += 1
    assert saved_tokens(shared_prefix_layout(shifted)) == 0
    assert saved_tokens(shared_prefix_layout(pack([Trajectory(a, [0] * 50)] * 2))) == 50


def test_a_sequence_inside_another_forwards_nothing():
    g = torch.Generator().manual_seed(4)
    a = _rand(60, g)
    batch = pack([Trajectory(a, [0] * 60), Trajectory(a[:30], [0] * 30), Trajectory(a[:40] + [5, 6], [0] * 42)])
    lay = shared_prefix_layout(batch)
    assert lay.seq_forwarded == (60, 0, 2)
    assert torch.equal(batch.input_ids[lay.keep][lay.expand], batch.input_ids)
    mask = lay.attention_mask(batch.position_ids[lay.keep])[0, 0]
    assert torch.equal(mask, visible_by_definition(batch, lay))


# ---------------------------------------------------------------- on a real model


def _tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=110, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = attn  # after construction: flash_attention_2 too, on CPU
    return model


def _loss_and_grads(model, batch, share):
    model.zero_grad()
    policy = TrainablePolicy(model, share_prefixes=share)
    hidden = policy.lm.hidden_states(batch)
    lp = torch.log_softmax(model.lm_head(hidden), -1).gather(-1, batch.targets[:, None])[:, 0]
    # Every token's log-prob, weighted: rows inside shared prefixes carry gradient too.
    weights = torch.linspace(0.5, 1.5, batch.num_tokens)
    loss = -(lp * weights * (batch.targets > 0)).sum()
    loss.backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_shared_equals_separate(model, trajs, plain_attn: str | None = None):
    """The shared forward's hidden states equal each sequence forwarded alone
    (under `plain_attn` when the model's own attention cannot run without a
    plan), and its gradients the unshared packed forward's."""
    batch = pack(trajs)
    shared_h, shared_g = _loss_and_grads(model, batch, share=True)
    packed_h, packed_g = _loss_and_grads(model, batch, share=False)
    if plain_attn is not None:
        model.config._attn_implementation = plain_attn
    with torch.no_grad():
        separate = torch.cat([model.model(input_ids=torch.tensor([t.token_ids])).last_hidden_state[0]
                              for t in trajs])
    assert (shared_h - separate).abs().max() < 1e-4
    assert (packed_h - separate).abs().max() < 1e-4
    for name, g in packed_g.items():
        assert torch.allclose(shared_g[name], g, rtol=1e-4, atol=1e-5), name


@pytest.mark.parametrize("attn,checkpointing", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_shared_forward_and_backward_equal_separate_sequences(attn, checkpointing):
    """sdpa runs under tree attention inside a policy (one call per node),
    eager with the [M, M] mask; with gradient checkpointing the recomputed
    forward takes the same calls."""
    model = _tiny_llama(attn)
    if checkpointing:
        model.train()
        model.gradient_checkpointing_enable()
    trajs = bfcl_shaped(seed=5)
    assert saved_tokens(shared_prefix_layout(pack(trajs))) > pack(trajs).num_tokens / 2
    assert_shared_equals_separate(model, trajs)


def test_flash_attention_shares_under_tree_attention():
    """flash-attn's varlen kernel runs the prefix tree too (tests/model/test_tree_attention.py
    checks its call on CPU); the setting alone turns sharing off."""
    from rcgrpo.model.attention import TREE_PREFIX

    model = _tiny_llama("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    assert TrainablePolicy(model).lm.shares_prefixes
    assert model.config._attn_implementation == TREE_PREFIX + "flash_attention_2"
    assert not TrainablePolicy(model, share_prefixes=False).lm.shares_prefixes


# ---------------------------------------------------------------- the micro-batch plan


def bfcl_step(seed, groups, docs=3, group_size=(2, 6), shuffle=False):
    """Trajectories shaped like a BFCL step across entries: a preamble every
    group shares, API docs drawn from a small pool (entries that use the same
    classes share them), each group's own user turn, a reward token (two
    kinds) and sampled replies. `shuffle`: packed in random order, as RCTP
    batches are (one group there; here the group ids are kept)."""
    r = random.Random(seed)
    preamble = [r.randrange(100) for _ in range(r.randint(20, 50))]
    pool = [[r.randrange(100) for _ in range(r.randint(80, 300))] for _ in range(docs)]
    out = []
    for k in range(groups):
        prompt = preamble + r.choice(pool) + [r.randrange(100) for _ in range(r.randint(5, 30))]
        for _ in range(r.randint(*group_size)):
            reply = [r.randrange(100) for _ in range(r.randint(1, 80))]
            ids = prompt + [101 + r.randrange(2), 7, 8] + reply
            out.append(Trajectory(ids, [0] * (len(ids) - len(reply)) + [1] * len(reply), group=k))
    if shuffle:
        r.shuffle(out)
    return out


def forwarded(batch, plan):
    return [shared_prefix_layout(batch.select(b)).num_forwarded for b in plan]


@pytest.mark.parametrize("budget", [150, 300, 700, 5000])
def test_plan_keeps_groups_together_within_the_budget(budget):
    batch = pack(bfcl_shaped(seed=6, groups=4, group_size=4))
    plan = micro_batch_plan(batch, budget, share_prefixes=True)
    assert sorted(i for b in plan for i in b) == list(range(batch.num_seqs))
    assert all(b == sorted(b) for b in plan)
    group_of = batch.seq_group.tolist()
    for b, f in zip(plan, forwarded(batch, plan)):
        # Over the budget only when one group's part alone is (a part's first sequence is whole).
        assert f <= budget or len({group_of[i] for i in b}) == 1
    whole_group = shared_prefix_layout(batch.select([0, 1, 2, 3])).num_forwarded
    if budget >= whole_group:
        for b in plan:  # a group that fits is never split
            groups = {group_of[i] for i in b}
            assert all(sum(group_of[i] == g for i in b) == 4 for g in groups)
    unshared = balance_micro_batches(batch.seq_lens, budget)
    assert len(plan) <= len(unshared)


@pytest.mark.parametrize("seed", range(12))
def test_plan_properties_on_bfcl_steps(seed):
    """Every sequence once; each micro-batch within the budget unless it is one
    sequence over it alone; groups that fit whole; `min_bins` micro-batches at
    least; and never more forwarded tokens than the planner this one replaced
    (groups costed alone, longest first into the lightest micro-batch: where
    every group fits, that is all it did)."""
    r = random.Random(seed)
    batch = pack(bfcl_step(seed, groups=r.randint(1, 10), shuffle=r.random() < 0.5))
    group_of = batch.seq_group.tolist()
    members = {g: [s for s in range(batch.num_seqs) if group_of[s] == g] for g in set(group_of)}
    alone = {g: shared_prefix_layout(batch.select(m)).num_forwarded for g, m in members.items()}
    for budget in (r.randint(100, 400), max(alone.values()) + r.randint(0, 600)):
        min_bins = r.choice([1, 1, 3])
        plan = micro_batch_plan(batch, budget, share_prefixes=True, min_bins=min_bins)
        assert sorted(i for b in plan for i in b) == list(range(batch.num_seqs))
        assert len(plan) >= min(min_bins, batch.num_seqs)
        tokens = forwarded(batch, plan)
        assert all(f <= budget or len(b) == 1 for b, f in zip(plan, tokens))
        if budget < max(alone.values()) or min_bins > 1:
            continue
        for g, m in members.items():
            assert any(set(m) <= set(b) for b in plan), f"group {g} split though it fits"
        gs = list(members)
        old = [sorted(s for u in b for s in members[gs[u]])
               for b in balance_micro_batches([alone[g] for g in gs], budget)]
        assert sum(tokens) <= sum(forwarded(batch, old))


def test_groups_that_share_docs_land_together():
    """Four groups packed with their docs alternating (A, B, A, B); two of one
    docs fit a micro-batch, two of different docs do not: each micro-batch
    holds one docs' groups and the docs are forwarded once each. (Costing each
    group alone put every group in a micro-batch of its own.)"""
    r = random.Random(8)
    preamble = [r.randrange(100) for _ in range(40)]
    docs = [[r.randrange(100) for _ in range(300)] for _ in range(2)]
    trajs = []
    for k in range(4):
        prompt = preamble + docs[k % 2] + [r.randrange(100) for _ in range(10)]
        for i in range(3):
            reply = [r.randrange(100) for _ in range(20)]
            ids = prompt + [101 + i % 2, 7, 8] + reply
            trajs.append(Trajectory(ids, [0] * (len(ids) - 20) + [1] * 20, group=k))
    batch = pack(trajs)
    plan = micro_batch_plan(batch, 600, share_prefixes=True)
    group_of = batch.seq_group.tolist()
    assert sorted(sorted({group_of[i] for i in b}) for b in plan) == [[0, 2], [1, 3]]
    assert all(f <= 600 for f in forwarded(batch, plan))


def test_rctp_pairs_land_together():
    """An RCTP batch is one group of shuffled records; an entry's expert and
    failure records share everything up to the reward tag. A budget that
    holds two records of one entry, not of two: each micro-batch is a pair."""
    r = random.Random(9)
    preamble = [r.randrange(100) for _ in range(40)]
    records = []
    for entry in range(4):
        prompt = preamble + [r.randrange(100) for _ in range(300)]
        for tag in (101, 102):
            reply = [r.randrange(100) for _ in range(30)]
            records.append((entry, Trajectory(prompt + [tag] + reply, [0] * 341 + [1] * 30)))
    r.shuffle(records)
    batch = pack([t for _, t in records])
    plan = micro_batch_plan(batch, 450, share_prefixes=True)
    assert sorted(sorted(records[i][0] for i in b) for b in plan) == [[e, e] for e in range(4)]


def test_plan_without_sharing_is_the_length_balance():
    batch = pack(bfcl_shaped(seed=7))
    assert micro_batch_plan(batch, 200, share_prefixes=False) == balance_micro_batches(batch.seq_lens, 200)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        micro_batch_plan(batch, 0, share_prefixes=True)
