"""Rollout engines on the first step of RC-GRPO rollouts: 4 BFCL prompts x G=5.

Same prompts (one entry per category, reward tag drawn per rollout), same
sampling settings and max tokens, fp32 on CPU, both engines in this process.
Reports generated tokens/s of vLLM and of the transformers engine, their ratio
(target >= 2), and the time of one weight swap of the 135M model (target < 1 s).
Run: pytest benchmarks/test_rollout.py --benchmark-only -s
"""
import os
import random
import time

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

G = 5
MAX_TOKENS = 64
DOC_STYLE = "compact_no_response"  # ~3-4k-token prompts; the shortest prompt form
RESULTS: dict[str, float] = {}


@pytest.fixture(scope="module")
def policy():
    from rcgrpo.models import load_policy

    return load_policy()


@pytest.fixture(scope="module")
def prompts(policy):
    from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test
    from rcgrpo.envs.data import CATEGORIES
    from rcgrpo.prompts import ChatTokens, initial_messages
    from rcgrpo.reward_tokens import DrawPerRollout

    train, _ = split_train_test(load_entries())
    entries = [next(e for e in train if e.category == c) for c in CATEGORIES]
    chat = ChatTokens(policy.tokenizer)
    tokens = DrawPerRollout(0.5).draw(len(entries) * G, random.Random(0))
    return [
        chat.prompt_ids(initial_messages(Episode(e), tokens[i * G + k], DOC_STYLE))
        for i, e in enumerate(entries)
        for k in range(G)
    ]


def sampling(n):
    from rcgrpo.rollout.engine import SamplingConfig

    return [SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, seed=i) for i in range(n)]


@pytest.fixture(scope="module")
def vllm_engine(policy):
    pytest.importorskip("vllm")
    from rcgrpo.rollout.vllm_engine import VLLMEngine

    start = time.perf_counter()
    engine = VLLMEngine(policy.path, max_model_len=8192)
    RESULTS["vllm_start_s"] = time.perf_counter() - start
    engine.generate([[1, 2, 3]], sampling(1))  # warm-up on an unrelated prompt
    return engine


def _run(engine, prompts):
    outs = engine.generate(prompts, sampling(len(prompts)))
    return sum(len(o[0].token_ids) for o in outs)


def _throughput(benchmark, engine, prompts, key):
    generated = {}

    def once():
        if hasattr(engine, "llm"):
            engine.llm.reset_prefix_cache()  # no help from earlier runs; sharing within the batch counts
        generated["n"] = _run(engine, prompts)

    benchmark.pedantic(once, rounds=1, iterations=1, warmup_rounds=0)
    seconds = benchmark.stats.stats.mean
    RESULTS[key] = generated["n"] / seconds
    benchmark.extra_info.update(generated_tokens=generated["n"], tokens_per_s=RESULTS[key],
                                prompt_tokens=sum(map(len, prompts)))
    print(f"\n{key}: {generated['n']} tokens in {seconds:.1f} s = {RESULTS[key]:.1f} tokens/s")


def test_vllm_generation_throughput(benchmark, vllm_engine, prompts):
    _throughput(benchmark, vllm_engine, prompts, "vllm_tokens_per_s")


def test_hf_generation_throughput(benchmark, policy, prompts):
    from rcgrpo.rollout.hf_engine import HFEngine

    engine = HFEngine(policy.model, policy.tokenizer, max_batch_size=5)
    engine.generate([[1, 2, 3]], sampling(1))
    _throughput(benchmark, engine, prompts, "hf_tokens_per_s")
    if "vllm_tokens_per_s" in RESULTS:
        ratio = RESULTS["vllm_tokens_per_s"] / RESULTS["hf_tokens_per_s"]
        benchmark.extra_info["vllm_over_hf"] = ratio
        print(f"vLLM / HF throughput: {ratio:.2f}x (target >= 2x)")
        assert ratio >= 2.0


def test_weight_swap_time(benchmark, vllm_engine, policy):
    params = list(policy.model.named_parameters())
    benchmark.pedantic(vllm_engine.load_weights, args=(params,), rounds=3, iterations=1, warmup_rounds=1)
    print(f"\nweight swap (135M, fp32): min {benchmark.stats.stats.min:.3f} s, "
          f"mean {benchmark.stats.stats.mean:.3f} s (target < 1 s)")
    assert benchmark.stats.stats.min < 1.0
