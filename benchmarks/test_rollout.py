"""Rollout engines on the first step of RC-GRPO rollouts: BFCL prompts x G,
a reward tag drawn per rollout, the same sampling settings and max tokens,
fp32 on CPU, both engines in this process.

Sizes (``benchmarks/scale.py``): quick, one `base` entry x G=5, 32 new
tokens; full, one entry per category x G=5, 64 new tokens; smoke, one entry
x G=2, 8 new tokens.

Rows: vLLM's seconds per 1,000 generated tokens against the transformers
engine's (HF ``generate``; target: vLLM at least 2x the throughput, time
<= 0.5x), the time of one weight swap of the 135M model into the live engine
(target < 1 s) and the engine's start-up (reported).
"""
import ctypes
import gc
import os
import random
import time

import pytest

from benchmarks import scale
from benchmarks.scoreboard import Comparison, Figure

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

G = scale.pick(smoke=2, quick=5)
MAX_TOKENS = scale.pick(smoke=8, quick=32, full=64)
N_CATEGORIES = scale.pick(smoke=1, quick=1, full=4)
DOC_STYLE = "compact_no_response"  # ~3-4k-token prompts; the shortest prompt form
RESULTS: dict = {}
pytestmark = [pytest.mark.benchmark(group="generation: vLLM vs HF generate, weight swap"), pytest.mark.in_process]


@pytest.fixture(scope="module")
def policy():
    from rcgrpo.model.loading import load_policy

    yield load_policy()
    # The engine and models run in this process: give their memory back
    # before the next module's benchmark programs start beside it.
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(scope="module")
def prompts(policy):
    from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
    from rcgrpo.conditioning.reward_tokens import DrawPerRollout
    from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test
    from rcgrpo.envs.data import CATEGORIES

    train, _ = split_train_test(load_entries())
    entries = [next(e for e in train if e.category == c) for c in CATEGORIES[:N_CATEGORIES]]
    chat = ChatTokens(policy.tokenizer)
    tokens = DrawPerRollout(0.5).draw(len(entries) * G, random.Random(0))
    return [
        chat.prompt_ids(initial_messages(Episode(e), tokens[i * G + k], DOC_STYLE))
        for i, e in enumerate(entries)
        for k in range(G)
    ]


def _shape(prompts) -> str:
    return (f"cpu fp32 135M, {len(prompts)} prompts ({sum(map(len, prompts)) // len(prompts)} tokens avg), "
            f"<= {MAX_TOKENS} new")


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
    yield engine
    engine.close()


def _seconds_per_1k(benchmark, engine, prompts, key):
    generated = {}

    def once():
        if hasattr(engine, "llm"):
            engine.llm.reset_prefix_cache()  # no help from earlier runs; sharing within the batch counts
        outs = engine.generate(prompts, sampling(len(prompts)))
        generated["n"] = sum(len(o[0].token_ids) for o in outs)

    benchmark.pedantic(once, rounds=1, iterations=1, warmup_rounds=0)
    seconds = benchmark.stats.stats.mean
    RESULTS[key] = 1000 * seconds / generated["n"]
    benchmark.extra_info.update(generated_tokens=generated["n"], seconds_per_1k_tokens=RESULTS[key],
                                prompt_tokens=sum(map(len, prompts)))


def test_vllm_generation(benchmark, board, vllm_engine, prompts):
    _seconds_per_1k(benchmark, vllm_engine, prompts, "vllm")
    board.record(Figure(group="generation", name="vLLM engine start-up", value=RESULTS["vllm_start_s"], unit="s",
                        shape="cpu fp32 135M, max_model_len 8192"))


def test_hf_generation(benchmark, board, policy, prompts):
    from rcgrpo.rollout.hf_engine import HFEngine

    engine = HFEngine(policy.model, policy.tokenizer, max_batch_size=5)
    engine.generate([[1, 2, 3]], sampling(1))
    _seconds_per_1k(benchmark, engine, prompts, "hf")
    if "vllm" in RESULTS:
        board.record(Comparison(group="generation", name="rollout generation", ours="rcgrpo vLLM engine",
                                peer="HF generate (rcgrpo HFEngine)", ours_s=RESULTS["vllm"], peer_s=RESULTS["hf"],
                                shape=_shape(prompts), per="1k generated tokens", max_time_ratio=0.5))


def test_weight_swap_time(benchmark, board, vllm_engine, policy):
    params = list(policy.model.named_parameters())
    benchmark.pedantic(vllm_engine.load_weights, args=(params,), rounds=3, iterations=1, warmup_rounds=1)
    board.record(Figure(group="generation", name="weight swap into the live engine (fastest of 3)",
                        value=benchmark.stats.stats.min, unit="s", shape="cpu fp32 135M", max_value=1.0))
