"""Shared, expensive fixtures: the real SmolLM2 policy and one in-process vLLM engine.

Starting vLLM costs ~15 s on the 2-core CPU machine, so every test of this
folder shares one engine. Tests that change its weights put the originals back.
"""
import os

import pytest

from tests.required import require

# Before vLLM is imported anywhere: keep the engine in this process, with a
# small KV cache (GiB) that fits beside the HF model.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

MAX_MODEL_LEN = 8192


@pytest.fixture(scope="session")
def policy():
    from rcgrpo.models import load_policy

    return load_policy()  # converts the embedded GGUF once (~20 s), cached after


@pytest.fixture(scope="session")
def tokenizer(policy):
    return policy.tokenizer


@pytest.fixture(scope="session")
def vllm_engine(policy):
    require("vllm", "cpu")
    from rcgrpo.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(policy.path, max_model_len=MAX_MODEL_LEN, debug=True)


@pytest.fixture(scope="session")
def entries():
    from rcgrpo.envs.bfcl import load_entries, split_train_test

    train, _ = split_train_test(load_entries())
    return train


@pytest.fixture
def chat_ids(tokenizer):
    def make(text, system="You are a helpful assistant."):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        return tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]

    return make
