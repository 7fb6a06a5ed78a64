"""The transformers engine (machines without vLLM) and engine selection."""
import subprocess
import sys
import textwrap

import pytest
import torch

from rcgrpo.rollout.engine import SamplingConfig
from rcgrpo.rollout.hf_engine import HFEngine


def test_left_padded_batch_equals_single_prompts_and_logprobs_match_forward(policy, chat_ids):
    engine = HFEngine(policy.model, policy.tokenizer)
    prompts = [chat_ids("Hi"), chat_ids("What is the capital of France? Answer briefly.")]
    greedy = SamplingConfig(temperature=0.0, max_tokens=10)
    batched = [o[0] for o in engine.generate(prompts, greedy)]
    alone = [engine.generate([p], greedy)[0][0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    for g in batched:  # cut after <|im_end|>, no padding leaks into the result
        assert policy.tokenizer.eos_token_id not in g.token_ids[:-1]

    sampled = engine.generate(prompts, SamplingConfig(temperature=0.8, max_tokens=12, n=2, seed=5))
    assert [len(o) for o in sampled] == [2, 2]
    again = engine.generate(prompts, SamplingConfig(temperature=0.8, max_tokens=12, n=2, seed=5))
    assert [[g.token_ids for g in o] for o in sampled] == [[g.token_ids for g in o] for o in again]
    with torch.no_grad():
        for p, gens in zip(prompts, sampled):
            for g in gens:
                logits = policy.model(torch.tensor([p + g.token_ids])).logits[0, len(p) - 1 : -1] / 0.8
                ref = logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
                # Padding changes the attention kernels' summation, not the math.
                torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-3, rtol=0)


def test_load_weights_copies_into_the_model(policy):
    import copy

    model = copy.deepcopy(policy.model)
    engine = HFEngine(model, policy.tokenizer)
    new = {n: t + 1.0 for n, t in policy.model.state_dict().items()}  # includes the tied alias lm_head.weight
    engine.load_weights(new.items())
    torch.testing.assert_close(model.model.norm.weight, policy.model.model.norm.weight + 1.0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_without_vllm_the_hf_engine_is_chosen_with_a_notice(policy):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["vllm"] = None  # makes `import vllm` raise ImportError, as if not installed
        from rcgrpo.rollout import make_engine
        engine = make_engine("auto", {str(policy.path)!r})
        print("ENGINE", engine.name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ENGINE hf" in out.stdout
    notices = [line for line in out.stderr.splitlines() if "vLLM is not installed" in line]
    assert len(notices) == 1, out.stderr[-2000:]


def _tiny_loaded_model():
    from types import SimpleNamespace

    from rcgrpo.model.loading import LoadedModel

    model = torch.nn.Linear(2, 2)
    model.generation_config = None
    return LoadedModel(model=model, tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=1), path=None)


def test_the_hf_engine_generates_with_the_loaded_model_it_is_given(tmp_path):
    from rcgrpo.rollout import make_engine

    loaded = _tiny_loaded_model()
    engine = make_engine("hf", tmp_path / "never-read", loaded=loaded)  # no folder: nothing is loaded
    assert engine.name == "hf" and engine.model is loaded.model and engine.tokenizer is loaded.tokenizer
    with pytest.warns(DeprecationWarning, match="loaded="):
        old = make_engine("hf", tmp_path / "never-read", policy=loaded)  # the keyword's old name
    assert old.model is loaded.model
