"""The packed forward (rcgrpo.model.attention, run through TrainablePolicy): the
proof that it equals separate forwards on a real transformers model, forward
and backward, and why each piece of the attention set-up is needed."""
from __future__ import annotations

import pytest
import torch

from rcgrpo.model.attention import additive_mask, block_causal_mask, default_attn_implementation
from rcgrpo.model.packing import Trajectory, pack
from rcgrpo.model.policy import TrainablePolicy


def packed_forward(model, batch):
    return TrainablePolicy(model).lm.hidden_states(batch)


def test_block_causal_mask_shape_and_content():
    m = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))
    assert m.shape == (1, 1, 5, 5) and m.dtype == torch.bool
    expect = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m[0, 0], expect)
    add = additive_mask(m, torch.float32)
    assert add[0, 0, 1, 0] == 0 and add[0, 0, 2, 0] == torch.finfo(torch.float32).min


# ---------------------------------------------------------------- the proof


def _tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def _ragged(vocab: int, lens=(7, 19, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _separate_hidden(model, seqs):
    return torch.cat([model.model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_separate_forwards(attn):
    model = _tiny_llama(attn)
    seqs = _ragged(model.config.vocab_size)
    batch = pack([Trajectory(s, [0] * len(s)) for s in seqs])
    with torch.no_grad():
        packed = packed_forward(model, batch)
        separate = _separate_hidden(model, seqs)
    assert packed.shape == (batch.num_tokens, model.config.hidden_size)
    assert (packed - separate).abs().max() < 1e-4


def test_packed_backward_equals_separate_backward():
    """Gradients too: training on a packed batch is training on the sequences."""
    model = _tiny_llama("sdpa")
    seqs = _ragged(model.config.vocab_size)
    batch = pack([Trajectory(s, [0] + [1] * (len(s) - 1)) for s in seqs])

    def grads(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def packed_loss():
        logits = model.lm_head(packed_forward(model, batch))
        lp = torch.log_softmax(logits, -1).gather(-1, batch.targets[:, None])[:, 0]
        return -(lp * batch.loss_mask).sum()

    def separate_loss():
        total = 0.0
        for s in seqs:
            logits = model(input_ids=torch.tensor([s])).logits[0, :-1]
            total = total - torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None]).sum()
        return total

    a, b = grads(packed_loss), grads(separate_loss)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_position_ids_alone_do_not_separate_sequences(attn):
    """Why the packed forward passes a mask: a plain call with restarted
    position_ids (use_cache at its default) lets sequences attend to each other."""
    model = _tiny_llama(attn)
    seqs = _ragged(model.config.vocab_size)
    batch = pack([Trajectory(s, [0] * len(s)) for s in seqs])
    with torch.no_grad():
        pos_only = model.model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None])
        separate = _separate_hidden(model, seqs)
    first = batch.seq_lens[0]
    # The first sequence sees nothing before it, so it matches; later ones do not.
    assert (pos_only.last_hidden_state[0, :first] - separate[:first]).abs().max() < 1e-4
    assert (pos_only.last_hidden_state[0] - separate).abs().max() > 1e-2


def test_eager_with_bool_mask_is_wrong():
    """Why the eager branch converts the mask: eager adds a bool mask as 0/1."""
    model = _tiny_llama("eager")
    seqs = _ragged(model.config.vocab_size)
    batch = pack([Trajectory(s, [0] * len(s)) for s in seqs])
    with torch.no_grad():
        wrong = model.model(
            input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
            attention_mask=block_causal_mask(batch.cu_seqlens), use_cache=False,
        ).last_hidden_state[0]
        separate = _separate_hidden(model, seqs)
    assert (wrong - separate).abs().max() > 1e-2


def test_a_policy_runs_sdpa_as_tree_attention_and_plain_calls_stay_sdpa():
    """Inside a policy an sdpa model runs under tree attention; a call
    without a tree plan (here: generate over a left-padded batch) computes
    what sdpa computes."""
    from rcgrpo.model.attention import TREE_PREFIX

    model = _tiny_llama("sdpa")
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

    def greedy():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=6, do_sample=False,
                                  pad_token_id=0, output_scores=True, return_dict_in_generate=True)

    before = greedy()
    TrainablePolicy(model)
    assert model.config._attn_implementation == TREE_PREFIX + "sdpa"
    after = greedy()
    assert torch.equal(after.sequences, before.sequences)
    for a, b in zip(after.scores, before.scores):
        assert torch.allclose(a, b, atol=1e-5)
    eager = _tiny_llama("eager")
    TrainablePolicy(eager)
    assert eager.config._attn_implementation == "eager"


def test_default_attn_implementation_on_cpu():
    assert default_attn_implementation("cpu") == "sdpa"


def test_unsupported_attention_is_refused():
    model = _tiny_llama("sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="not supported"):
        packed_forward(model, pack([Trajectory([1, 2], [0, 1])]))


@pytest.mark.slow
def test_packed_forward_equals_separate_forwards_smollm2():
    from transformers import AutoModelForCausalLM

    from rcgrpo.model.loading import resolve_model_folder

    folder = resolve_model_folder(None)  # the embedded SmolLM2, converted on first use

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa").eval()
    seqs = _ragged(model.config.vocab_size, lens=(23, 41, 9), seed=3)
    batch = pack([Trajectory(s, [0] * len(s)) for s in seqs])
    with torch.no_grad():
        packed = packed_forward(model, batch)
        separate = _separate_hidden(model, seqs)
    assert (packed - separate).abs().max() < 1e-4
