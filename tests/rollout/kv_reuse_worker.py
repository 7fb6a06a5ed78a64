"""Sleep and wake the vLLM engine while freed heap memory full of NaN waits
for the next large allocation (run by tests/rollout/test_vllm_engine.py).

The parent starts this process with glibc told to serve every allocation from
its heap and never trim it (MALLOC_MMAP_MAX_=0, a huge MALLOC_TRIM_THRESHOLD_),
which makes certain what a long training process makes likely: a wake-up that
allocates its KV cache anew is handed the NaN-filled memory. Prints one JSON
line: per cycle, the NaN floats found in the KV cache after wake_up and
whether the replies' log-probs were finite and the tokens those of a cycle
without poison.
"""
import json
import math
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402

from rcgrpo.model.loading import load_tokenizer  # noqa: E402
from rcgrpo.rollout.engine import SamplingConfig  # noqa: E402
from rcgrpo.rollout.host_pages import as_bytes  # noqa: E402
from rcgrpo.rollout.vllm_engine import VLLMEngine  # noqa: E402


def main(folder: str, cycles: int = 2) -> None:
    tokenizer = load_tokenizer(folder)
    engine = VLLMEngine(folder, max_model_len=2048, kv_cache_gib=1)
    messages = [{"role": "user", "content": "List three prime numbers and say why each is prime."}]
    prompt = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=32, seed=7, logprobs=True)
    before = engine.generate([prompt], sampling)[0]
    kv_bytes = sum(st.nbytes() for st in engine._kv_storages())
    result = []
    for _ in range(cycles):
        engine.sleep()
        # What a training step leaves behind: tensors of a few MB, freed.
        poison = [torch.full((4 << 20,), float("nan")) for _ in range(int(1.3 * kv_bytes) // (16 << 20))]
        keep = torch.empty(1 << 16)  # noqa: F841 -- above the poison, so the heap cannot shrink past it
        del poison
        engine.wake_up()
        nan_floats = sum(int(as_bytes(st).view(torch.float32).isnan().sum()) for st in engine._kv_storages())
        after = engine.generate([prompt], sampling)[0]
        result.append({
            "nan_in_kv": nan_floats,
            "finite": all(math.isfinite(x) for g in after for x in g.logprobs),
            "same_tokens": [g.token_ids for g in after] == [g.token_ids for g in before],
        })
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
