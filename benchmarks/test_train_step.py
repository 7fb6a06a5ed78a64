"""One RC-GRPO update (forward + backward + optimizer step) on a fixed packed
batch of the small model: `--fused` (chunked fused-linear loss on CPU) vs the
reference path (full logits), time and peak memory, as ratios in one run.

The batch is real BFCL data: one group of an expert and a perturbed-expert
trajectory of a training entry, played through the agent loop and labelled
by the environment (rewards differ, so advantages are non-zero).
Peak memory is the max RSS of a fresh process that runs one update on one
path (ru_maxrss), so the paths cannot share allocator caches.

Run: pytest benchmarks/test_train_step.py --benchmark-only -s
"""
import json
import os
import subprocess
import sys

import pytest

STEP_SCRIPT = r"""
import dataclasses, json, resource, sys, time, torch
import kernels
from rcgrpo.batch import accumulation_weight, pack_micro_batches
from rcgrpo.config import parse_args
from rcgrpo.models import load_tokenizer, resolve_model_folder
from rcgrpo.policy import TrainablePolicy
from rcgrpo.training.losses import RLLossSettings, reference_logprobs, rl_loss
from rcgrpo.training.optimizer import make_optimizer
from benchmarks.test_train_step import fixed_batch
fused = sys.argv[1] == "fused"
folder = resolve_model_folder(None)
policy = TrainablePolicy.load(folder, parse_args([], check_files=False).model, torch.device("cpu"), reference=True)
batch = fixed_batch(load_tokenizer(folder))
batch = dataclasses.replace(batch, advantages=kernels.group_advantages(batch.rewards, batch.seq_group))
batch = dataclasses.replace(batch, ref_logp=reference_logprobs(policy, batch, True, 1.0))
opt, _ = make_optimizer(policy, 1e-6, 0.0, 1, 0.0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
total = 0.0
# As the trainer does: token-balanced micro-batches (one sequence each here;
# an N x N block mask over several 3k-token sequences does not fit on CPU).
for micro in pack_micro_batches(batch, 4096):
    loss, _ = rl_loss(policy.lm, micro, RLLossSettings(beta=0.1), fused=fused)
    weight = accumulation_weight(micro, batch, "grpo")
    (loss * weight).backward()
    total += float(loss) * weight
opt.step()
print(json.dumps({"seconds": time.perf_counter() - t0, "loss": total,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "before_mb": base / 1024, "tokens": batch.num_tokens}))
"""


def fixed_batch(tokenizer):
    """Expert + perturbed trajectories of one base entry (one group)."""
    from rcgrpo.batch import Trajectory, pack
    from rcgrpo.data.expert import expert_turns, perturbed_turns, play_script, script_from_turns
    from rcgrpo.envs.bfcl import load_entries, split_train_test
    from rcgrpo.rollout.agent_loop import RolloutConfig

    train, _ = split_train_test(load_entries(["base"]))
    cfg = RolloutConfig(max_new_tokens=1024, max_total_tokens=6144, doc_style="compact_no_response", progress=False)
    trajs = []
    for group, entry in enumerate(train[:1]):
        for turns in (expert_turns(entry), perturbed_turns(entry, "dropped", 0)):
            r = play_script(entry, tokenizer, script_from_turns(turns), cfg)
            trajs.append(Trajectory(r.token_ids, r.sampled_mask, group=group, reward=r.reward))
    return pack(trajs)


def run_path(path: str) -> dict:
    env = dict(os.environ, RCGRPO_PROGRESS="0")
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, path], capture_output=True, text=True,
                         timeout=1800, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RESULTS: dict = {}


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_rcgrpo_update(benchmark, path):
    result = benchmark.pedantic(lambda: run_path(path), rounds=1, iterations=1)
    RESULTS[path] = result
    benchmark.extra_info.update(result)
    print(f"\n{path}: {result['seconds']:.1f} s per update, peak RSS {result['peak_rss_mb']:.0f} MB, "
          f"{result['tokens']} tokens, loss {result['loss']:.6f}")


def test_fused_vs_reference_ratios(benchmark):
    if set(RESULTS) != {"reference", "fused"}:
        pytest.skip("needs both path benchmarks of this run")
    ref, fused = RESULTS["reference"], RESULTS["fused"]
    ratios = {"time_ratio": fused["seconds"] / ref["seconds"],
              "peak_mem_ratio": fused["peak_rss_mb"] / ref["peak_rss_mb"]}
    benchmark.extra_info.update(ratios)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\nfused / reference: time {ratios['time_ratio']:.2f}x, peak memory {ratios['peak_mem_ratio']:.2f}x")
    assert abs(fused["loss"] - ref["loss"]) < 1e-3
