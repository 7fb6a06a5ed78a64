"""The weight swap of a LoRA run: after one real adapter update, the merged
weights pushed by `TrainablePolicy.rollout_weights` make the in-process vLLM
engine score tokens as the HF merged model does, and the engine's embedding
holds the trained reward-token rows."""
import copy

import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.config import LoraConfig
from rcgrpo.model.loading import reward_token_ids
from rcgrpo.model.lora import wrap
from rcgrpo.model.packing import pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.rollout.engine import SamplingConfig
from rcgrpo.training.losses import LOSS_PATHS, sft_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from tests.training.conftest import chat_record

GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)


def greedy(engine, ids):
    g = engine.generate([ids], GREEDY)[0][0]
    return g.token_ids, g.logprobs


def moved(a, b) -> bool:
    return a[0] != b[0] or max(abs(x - y) for x, y in zip(a[1], b[1])) > 1e-3


def test_lora_update_reaches_the_engine_as_merged_weights(vllm_engine, policy, tokenizer, chat_ids):
    probe = chat_ids("List the files in the current directory.")
    original = greedy(vllm_engine, probe)
    torch.manual_seed(0)
    ids = list(reward_token_ids(tokenizer).values())
    model = wrap(copy.deepcopy(policy.model), LoraConfig(True, 8, 16.0, 0.0, ["q_proj", "v_proj", "o_proj", "down_proj"]),
                 ids)
    lp = TrainablePolicy(model, lora=True)
    records = [chat_record(tokenizer, f"List files {i}", "[ls(a=True)]", token, 1.0)
               for i, token in enumerate([HIGH_REWARD, LOW_REWARD])]
    batch = pack([r.trajectory() for r in records])
    optimizer, scheduler = make_optimizer(lp, 2e-2, 0.0, 1, 0.0)
    lp.train_mode()
    sft_loss(lp.lm, batch, LOSS_PATHS["fused"])[0].backward()
    clip_and_step(lp, optimizer, scheduler, 1.0)
    lp.eval_mode()
    merged = copy.deepcopy(model).merge_and_unload()  # the HF merged model, for reference
    trained_rows = merged.get_input_embeddings().weight[ids].detach()
    assert not torch.equal(trained_rows, policy.model.get_input_embeddings().weight[ids])
    try:
        vllm_engine.load_weights(lp.rollout_weights())  # debug engine: checksums of what was pushed
        engine_rows = vllm_engine.model.model.embed_tokens.weight[ids].float()
        torch.testing.assert_close(engine_rows, trained_rows, atol=0, rtol=0)
        after = greedy(vllm_engine, probe)
        assert moved(after, original), "the adapter update did not reach the engine"
        outs = vllm_engine.generate([probe], SamplingConfig(temperature=1.0, max_tokens=16, n=2, seed=5))[0]
        diffs = []
        with torch.no_grad():
            for g in outs + [vllm_engine.generate([probe], GREEDY)[0][0]]:
                ids = torch.tensor([probe + g.token_ids])
                logits = merged(ids).logits[0, len(probe) - 1:-1].float()
                ref = logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
                diffs.append((ref - torch.tensor(g.logprobs)).abs())
        diffs = torch.cat(diffs)
        # fp32 on both sides: only kernel summation order differs.
        assert diffs.mean() < 1e-4 and diffs.max() < 1e-3, (diffs.mean(), diffs.max())
    finally:
        vllm_engine.load_weights(policy.model.named_parameters())  # the engine is shared
    assert not moved(greedy(vllm_engine, probe), original)
