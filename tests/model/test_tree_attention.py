"""Tree attention (rcgrpo.model.tree_attention): the plan against a brute-force
reading of what each token may see, and every back end, forward and backward,
against dense masked attention. The flash-attn call is checked here on CPU
through ``flash_varlen_reference``, this file's own implementation of
flash-attn's varlen semantics (cu_seqlens_q/k, causal aligned bottom-right)."""
from __future__ import annotations

import math

import pytest
import torch

from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.prefix_sharing import shared_prefix_layout
from rcgrpo.model.tree_attention import tree_attention, tree_attention_plan, varlen_inputs
from tests.model.test_prefix_sharing import (
    _tiny_llama,
    assert_shared_equals_separate,
    bfcl_shaped,
    visible_by_definition,
)


def flash_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=True):
    """flash_attn_varlen_func as documented, in plain PyTorch: sequence i's
    queries ``q[cu_q[i]:cu_q[i+1]]`` attend its keys ``k[cu_k[i]:cu_k[i+1]]``;
    with causal, query j sees keys up to ``j + len_k - len_q`` (aligned to the
    bottom-right corner); k/v heads are shared by groups of query heads (GQA)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max(b - a for a, b in zip(cu_q, cu_q[1:])) == max_seqlen_q
    assert max(b - a for a, b in zip(cu_k, cu_k[1:])) == max_seqlen_k
    acc = torch.promote_types(q.dtype, torch.float32)  # flash-attn accumulates in fp32 at least
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].to(acc)
        ki = k[cu_k[i]:cu_k[i + 1]].to(acc).repeat_interleave(group, dim=1)
        vi = v[cu_k[i]:cu_k[i + 1]].to(acc).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        if causal:
            n_q, n_k = qi.shape[0], ki.shape[0]
            allowed = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
            scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi).to(q.dtype))
    return torch.cat(outs)


def dense_attention(query, key, value, mask):
    """[1, H, M, D] attention under an [M, M] bool mask, GQA by repeating k/v heads."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-1, -2)) / math.sqrt(query.shape[-1])
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ value).transpose(1, 2)


def deep_tree(seed=0):
    """Synthetic trees of depth 3 and more: a shared root, two branches each
    with two sub-branches, sequences ending inside others, and a sequence of
    its own."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(0, 100, (n,), generator=g).tolist()
    root, a, b = r(40), r(25), r(30)
    seqs = [root + a + r(20), root + a + r(17) + r(3), root + b + r(22), root + b + r(18),
            root + a, root + [5] * 3, r(33), root + b + r(22)[:4]]
    return [Trajectory(s, [0] * (len(s) - 2) + [1, 1]) for s in seqs]


CASES = {"bfcl_groups": lambda: bfcl_shaped(seed=3), "deep_tree": deep_tree,
         "rctp_pairs": lambda: bfcl_shaped(seed=9, groups=2, group_size=2, tail=(30, 60))}


@pytest.mark.parametrize("case", CASES)
def test_plan_gathers_exactly_what_each_token_may_see(case):
    batch = pack(CASES[case]())
    layout = shared_prefix_layout(batch)
    pos = batch.position_ids[layout.keep]
    plan = tree_attention_plan(layout, pos)
    expect = visible_by_definition(batch, layout)
    cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
    got = torch.zeros_like(expect)
    for n in range(plan.num_nodes):
        n_q, n_k = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        keys = plan.key_index[cu_k[n]:cu_k[n + 1]]
        assert torch.equal(pos[keys], torch.arange(n_k)), "a node's keys are its sequence's positions from 0"
        for i in range(n_q):
            got[cu_q[n] + i, keys[:n_k - n_q + i + 1]] = True
    assert torch.equal(got, expect)
    # Exactly the tree's pairs: every allowed pair once, none more.
    assert plan.attended_pairs == int(expect.sum())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["sdpa", "flash_reference"])
def test_forward_and_backward_equal_dense_masked_attention(case, backend):
    batch = pack(CASES[case]())
    layout = shared_prefix_layout(batch)
    pos = batch.position_ids[layout.keep]
    plan = tree_attention_plan(layout, pos)
    m, g = layout.num_forwarded, torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, m, 8, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, 2, m, 8, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, 2, m, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1, m, 4, 8, generator=g, dtype=torch.float64)
    if backend == "sdpa":
        out = tree_attention(plan, query, key, value, backend="sdpa")
    else:  # exactly the arguments the flash back end passes to flash_attn_varlen_func
        inputs = varlen_inputs(plan, query, key, value)
        out = flash_varlen_reference(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                     inputs.max_seqlen_q, inputs.max_seqlen_k, causal=True)[None]
    grads = torch.autograd.grad((out * weight).sum(), (query, key, value))
    dense = dense_attention(query, key, value, layout.attention_mask(pos)[0, 0])
    dense_grads = torch.autograd.grad((dense * weight).sum(), (query, key, value))
    assert out.shape == dense.shape == (1, m, 4, 8)
    assert (out - dense).abs().max() < 1e-10
    for got, want in zip(grads, dense_grads):
        assert (got - want).abs().max() < 1e-10


def test_a_branch_off_a_short_prefix_no_longer_spans_the_groups_between():
    """Three groups share only a 20-token preamble: the last group's branch
    attends to the preamble and itself, not to the groups packed in between."""
    trajs = bfcl_shaped(seed=2, groups=3, group_size=2, preamble=20, docs=80)
    batch = pack(trajs)
    layout = shared_prefix_layout(batch)
    plan = tree_attention_plan(layout, batch.position_ids[layout.keep])
    assert plan.max_seqlen_k == max(batch.seq_lens)  # no node reads more than its own sequence


# ---------------------------------------------------------------- inside a real model


@pytest.mark.parametrize("base,checkpointing", [("sdpa", False), ("sdpa", True), ("flash_attention_2", False),
                                                ("flash_attention_2", True)])
@pytest.mark.parametrize("case", ["bfcl_groups", "deep_tree"])
def test_tree_forward_and_backward_equal_separate_sequences(base, checkpointing, case, monkeypatch):
    """A model under tree attention (``use_tree_attention``): hidden states
    equal each sequence forwarded alone, gradients equal the unshared packed
    forward's. flash_attention_2 runs here through the flash back end with
    flash_attn_varlen_func replaced by this file's reference."""
    from rcgrpo.model import tree_attention
    from rcgrpo.model.attention import TREE_PREFIX, use_tree_attention

    if base.startswith("flash"):
        def flash(inputs, scale, dropout):
            return flash_varlen_reference(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                          inputs.max_seqlen_q, inputs.max_seqlen_k, softmax_scale=scale)
        monkeypatch.setitem(tree_attention.TREE_BACKENDS, "flash", flash)
    model = _tiny_llama(base)
    use_tree_attention(model.config)
    assert model.config._attn_implementation == TREE_PREFIX + base
    if checkpointing:
        model.train()
        model.gradient_checkpointing_enable()
    # Each sequence alone runs plain sdpa: flash-attn itself is not installed here.
    assert_shared_equals_separate(model, CASES[case](), plain_attn="sdpa")


# ------------------------------------------- real BFCL groups, plain and LoRA


def bfcl_rollouts(entries, tokenizer, shape: str):
    """Real BFCL prompts with their reward tags: "rc-grpo", two entries of one
    category x G = 4 rollouts, the tag drawn per rollout (a two-branch tree
    below each prompt, and the preamble the entries share); "rctp", the
    expert (high) / failure (low) pair of each of two entries. Replies are
    short random token runs ending in the turn's end token."""
    from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
    from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
    from rcgrpo.envs.bfcl import Episode

    chat = ChatTokens(tokenizer)
    size = lambda e: len(chat.prompt_ids(initial_messages(Episode(e), None, "compact_no_response")))
    picked = sorted([e for e in entries if e.category == "base"][:40], key=size)[:2]  # the shortest: a fast test
    tags = [HIGH_REWARD, HIGH_REWARD, LOW_REWARD, HIGH_REWARD] if shape == "rc-grpo" else [HIGH_REWARD, LOW_REWARD]
    g = torch.Generator().manual_seed(7)
    out = []
    for k, entry in enumerate(picked):
        for tag in tags:
            prompt = chat.prompt_ids(initial_messages(Episode(entry), tag, "compact_no_response"))
            reply = torch.randint(0, len(tokenizer) - 2, (int(torch.randint(8, 24, (1,), generator=g)),),
                                  generator=g).tolist() + [chat.eot_id]
            out.append(Trajectory(prompt + reply, [0] * len(prompt) + [1] * len(reply), group=k))
    return out


@pytest.mark.slow  # forwards and backwards on real BFCL groups, plain and LoRA (~2-4 s each)
@pytest.mark.parametrize("shape", ["rc-grpo", "rctp"])
@pytest.mark.parametrize("lora", [False, True])
def test_real_bfcl_groups_tree_equals_dense_plain_and_lora(shape, lora, entries, tokenizer, tiny_folder):
    """A policy (tree attention over sdpa) on real BFCL groups: its hidden
    states and the gradients of what trains (every weight; under LoRA the
    adapters and the reward-token rows) are the dense forward's."""
    from transformers import AutoModelForCausalLM

    from rcgrpo.config import LoraConfig
    from rcgrpo.model.loading import reward_token_ids
    from rcgrpo.model.lora import wrap
    from rcgrpo.model.policy import TrainablePolicy

    batch = pack(bfcl_rollouts(entries, tokenizer, shape))
    layout = shared_prefix_layout(batch)
    assert layout.num_forwarded < batch.num_tokens / 2  # each prompt (and the entries' preamble) once
    model = AutoModelForCausalLM.from_pretrained(str(tiny_folder), dtype=torch.float32, attn_implementation="sdpa")
    if lora:
        ids = list(reward_token_ids(tokenizer).values())
        model = wrap(model, LoraConfig(True, 4, 8.0, 0.0, ["q_proj", "v_proj", "down_proj"]), ids)
        with torch.no_grad():  # adapters that change the output (B starts at 0)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    results = {}
    for share in (True, False):
        policy = TrainablePolicy(model, lora=lora, share_prefixes=share)
        model.zero_grad(set_to_none=True)
        hidden = policy.lm.hidden_states(batch)
        rows = batch.loss_mask  # the replies' rows only: [N, V] logits of 15k prompt tokens would be GBs
        logits = torch.nn.functional.linear(hidden[rows], policy.lm.lm_head_weight())
        (-torch.log_softmax(logits, -1).gather(-1, batch.targets[rows][:, None]).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share] = hidden.detach(), grads
    (tree_h, tree_g), (dense_h, dense_g) = results[True], results[False]
    assert (tree_h - dense_h).abs().max() < 1e-4
    assert tree_g.keys() == dense_g.keys() and tree_g
    if lora:
        assert all("lora_" in n or "trainable_tokens" in n for n in tree_g)
    for name, grad in dense_g.items():
        assert torch.allclose(tree_g[name], grad, rtol=1e-4, atol=1e-6), name
