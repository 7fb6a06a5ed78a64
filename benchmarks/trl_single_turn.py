"""TRL's side of ``benchmarks/test_vs_trl.py``: ``GRPOTrainer.train()`` (TRL
1.16) with our reward function on the work of ``benchmarks.single_turn``,
generating with HF ``generate`` (``single_turn.TRL_GENERATION`` says why not
vLLM colocate). One completion per forward/backward: the step's completions
are generated at once and the gradient accumulated over them.

    python -m benchmarks.trl_single_turn OUT_DIR    (env BENCH_GC=true|false, BENCH_THREADS)

prints one JSON line: per-step times (generation = TRL's
``_generate_and_score_completions``, which also pushes weights and scores),
rewards and the process's peak RSS (VmHWM).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from benchmarks.fresh_process import status_bytes
from benchmarks.single_turn import DOC_STYLE, LR, MAX_NEW, N_PROMPTS, STEPS, TRL_GENERATION, G, entries, reward


def main(out_dir: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rcgrpo.conditioning.prompts import initial_messages
    from rcgrpo.envs.bfcl import Episode
    from rcgrpo.model.loading import resolve_model_folder

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    folder = str(resolve_model_folder(None))
    jobs = entries()
    by_id = {e.id: e for e in jobs}
    data = Dataset.from_dict({"prompt": [initial_messages(Episode(e), None, DOC_STYLE) for e in jobs],
                              "entry_id": [e.id for e in jobs]})

    def bfcl_reward(completions, entry_id, **kwargs):  # ours, as a TRL reward function
        return [reward(by_id[i], c[0]["content"]) for c, i in zip(completions, entry_id)]

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=1, num_generations=G,
                      gradient_accumulation_steps=N_PROMPTS * G, max_completion_length=MAX_NEW, max_steps=STEPS,
                      learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      beta=0.0, loss_type="grpo", temperature=1.0, top_p=1.0, epsilon=0.2,
                      use_vllm=TRL_GENERATION == "vllm", vllm_mode="colocate",
                      use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
                      gradient_checkpointing=os.environ.get("BENCH_GC", "true") == "true",
                      disable_tqdm=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=bfcl_reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(folder))
    gen_s = []
    generate = trainer._generate_and_score_completions

    def timed_generate(batch):
        t = time.perf_counter()
        out = generate(batch)
        gen_s.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed_generate
    steps = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - self.t0
            steps.append({"generation_s": gen_s[-1], "update_s": total - gen_s[-1], "total_s": total})

    trainer.add_callback(StepTimes())
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    for s, h in zip(steps, history):
        s["reward_mean"] = h["reward"]
    # VmHWM, not ru_maxrss: after fork + exec, ru_maxrss also counts the parent's pages at the fork
    return {"steps": steps, "peak_rss_mb": status_bytes("VmHWM:") / (1 << 20),
            "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
