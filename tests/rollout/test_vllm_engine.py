"""The colocated vLLM engine: generation from ids, weight swap, log-prob agreement."""
import copy

import pytest
import torch

from rcgrpo.rollout.engine import SamplingConfig
from tests.required import require

pytestmark = pytest.mark.slow

GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)
QUESTIONS = ["What is the capital of France?", "List three prime numbers.", "Write a haiku about rain."]


def hf_greedy(model, prompt, max_new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=2)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids  # up to and including <|im_end|>


def test_engine_runs_in_process_and_generates_from_ids(vllm_engine, policy, chat_ids):
    assert isinstance(vllm_engine.model, torch.nn.Module)  # the live model is ours to touch
    prompts = [chat_ids(q) for q in QUESTIONS]
    outs = vllm_engine.generate(prompts, GREEDY)
    assert [len(o) for o in outs] == [1, 1, 1]
    for p, o in zip(prompts, outs):
        g = o[0]
        assert g.token_ids == hf_greedy(policy.model, p, GREEDY.max_tokens)
        assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp in g.logprobs)
        assert g.finish_reason in ("stop", "length")


def test_n_and_per_request_seed(vllm_engine, chat_ids):
    p = chat_ids("Tell me a story.")
    s = SamplingConfig(temperature=1.0, max_tokens=8, n=3, seed=7)
    a = vllm_engine.generate([p], s)[0]
    assert len(a) == 3
    # Same seed, different batch company: same tokens.
    b = vllm_engine.generate([chat_ids("Hi"), p], [SamplingConfig(max_tokens=8, seed=1), s])[1]
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    c = vllm_engine.generate([p], SamplingConfig(temperature=1.0, max_tokens=8, n=3, seed=8))[0]
    assert [g.token_ids for g in c] != [g.token_ids for g in a]


def test_sleep_on_cpu_returns_the_kv_cache_and_wake_up_gives_it_back_zeroed(vllm_engine, chat_ids):
    """vLLM has no sleep mode on CPU: the engine's own sleep returns the KV
    cache's pages to the OS (the update phase runs without them) and keeps
    the weights; after wake_up the cache reads as zero whatever it held (here
    NaN in every byte, as stale memory may) and the same seeded request
    samples the same tokens."""
    import psutil

    from rcgrpo.rollout.host_pages import as_bytes

    prompt = chat_ids("Name a colour.")
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, n=2, seed=5, logprobs=True)
    before = vllm_engine.generate([prompt], sampling)[0]
    storages = vllm_engine._kv_storages()
    size = sum(st.nbytes() for st in storages)
    pointers = [st.data_ptr() for st in storages]
    assert size >= 1 << 30
    for st in storages:
        as_bytes(st).fill_(0xFF)  # every page resident, every float NaN
    rss = psutil.Process().memory_info().rss
    vllm_engine.sleep()
    try:
        assert vllm_engine.released_kv_bytes >= size - (64 << 10)  # all but the partial pages at the ends
        assert rss - psutil.Process().memory_info().rss >= 0.9 * size
        with pytest.raises(RuntimeError, match="asleep"):
            vllm_engine.generate([prompt], sampling)
        vllm_engine.sleep()  # twice is once
    finally:
        vllm_engine.wake_up()
    assert [st.data_ptr() for st in vllm_engine._kv_storages()] == pointers  # the buffer vLLM holds, kept
    assert all(int(as_bytes(st).count_nonzero()) == 0 for st in storages)
    after = vllm_engine.generate([prompt], sampling)[0]
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
    for a, b in zip(after, before):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_wake_up_never_hands_the_kv_cache_memory_another_tensor_freed(model_dir):
    """The learning study's engine fault: every reply of a phase garbage, with
    NaN log-probs, sometimes through three pushes of the same weights. The
    KV cache came back from sleep as a new allocation, and glibc serves one
    from freed heap memory when it has a big enough chunk, with its old
    content; NaN in an unwritten slot of a block reaches every reply. A
    process whose allocator is made to do that every time
    (`kv_reuse_worker.py`) must find the cache zero and the replies those
    of an unpoisoned engine, cycle after cycle."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    require("vllm", "cpu")
    env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40), VLLM_CPU_KVCACHE_SPACE="1")
    worker = Path(__file__).with_name("kv_reuse_worker.py")
    done = subprocess.run([sys.executable, str(worker), str(model_dir)], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    cycles = json.loads(done.stdout.strip().splitlines()[-1])
    assert cycles == [{"nan_in_kv": 0, "finite": True, "same_tokens": True}] * 2


def test_weight_swap_matches_hf_on_the_same_perturbed_weights(vllm_engine, policy, chat_ids):
    prompts = [chat_ids(q) for q in QUESTIONS]
    before = [o[0].token_ids for o in vllm_engine.generate(prompts, GREEDY)]
    perturbed = copy.deepcopy(policy.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Every tensor, the tied embedding / lm_head included, moves far enough
        # that a stale copy anywhere changes the greedy output.
        for _, p in perturbed.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.float().std() * 0.3)
    try:
        vllm_engine.load_weights(perturbed.named_parameters())  # debug=True: checksums too
        print(f"\nweight swap of the 135M model: {vllm_engine.last_swap_seconds:.3f} s")
        after = [o[0].token_ids for o in vllm_engine.generate(prompts, GREEDY)]
        expected = [hf_greedy(perturbed, p, GREEDY.max_tokens) for p in prompts]
        assert after == expected
        assert after != before
    finally:
        vllm_engine.load_weights(policy.model.named_parameters())
    assert [o[0].token_ids for o in vllm_engine.generate(prompts, GREEDY)] == before


def test_swap_of_only_the_tied_embedding_reaches_the_output_layer(vllm_engine, policy, chat_ids):
    """vLLM's layerwise reload re-packs a tied lm_head only through our explicit fix."""
    prompt = chat_ids(QUESTIONS[0])
    model = copy.deepcopy(policy.model)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(torch.linspace(0.5, 1.5, emb.shape[1]))  # changes input and output embedding alike
    try:
        vllm_engine.load_weights(model.named_parameters())
        got = vllm_engine.generate([prompt], GREEDY)[0][0].token_ids
        assert got == hf_greedy(model, prompt, GREEDY.max_tokens)
    finally:
        vllm_engine.load_weights(policy.model.named_parameters())


def test_wrapped_parameter_names_are_mapped(vllm_engine, policy, chat_ids):
    prompt = chat_ids(QUESTIONS[1])
    before = vllm_engine.generate([prompt], GREEDY)[0][0].token_ids
    vllm_engine.load_weights((f"module._orig_mod.{n}", t) for n, t in policy.model.named_parameters())
    assert vllm_engine.generate([prompt], GREEDY)[0][0].token_ids == before
    with pytest.raises(RuntimeError, match="unloaded"):
        vllm_engine.load_weights(list(policy.model.named_parameters())[:3])
    vllm_engine.load_weights(policy.model.named_parameters())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_agree_with_trainer_forward(vllm_engine, policy, chat_ids, temperature):
    prompts = [chat_ids(q) for q in QUESTIONS]
    outs = vllm_engine.generate(prompts, SamplingConfig(temperature=temperature, max_tokens=24, n=2, seed=3))
    diffs = []
    with torch.no_grad():
        for p, gens in zip(prompts, outs):
            for g in gens:
                ids = torch.tensor([p + g.token_ids])
                logits = policy.model(ids).logits[0, len(p) - 1 : -1].float() / temperature
                ref = logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
                diffs.append((ref - torch.tensor(g.logprobs)).abs())
    diffs = torch.cat(diffs)
    print(f"\nlog-prob |vLLM - HF forward| at T={temperature}: mean {diffs.mean():.2e}, max {diffs.max():.2e} "
          f"over {diffs.numel()} tokens")
    # fp32 on both sides: only kernel summation order differs (~1e-5 seen).
    assert diffs.mean() < 1e-4
    assert diffs.max() < 1e-3
