"""What keeping the engine's log-probs costs the fused update: the
engine/trainer agreement (one LM-head pass over the loss rows, from the
hidden states the loss pass already has) and truncated importance sampling
on top, against the plain fused update, at the train-step benchmark's
shapes (one expert + perturbed-expert group of a base entry, the 135M model,
fp32, `--fused`).

One subprocess times all three variants, alternating round by round so that
they share the machine's state; the median of the rounds is compared as
tokens per second. beta = 0 keeps the reference forward (the same for every
variant) out of the timing, so the overhead is measured against the smallest
update. Target (issue: rollout-trainer agreement): < 3% slower each.

Run: pytest benchmarks/test_engine_logprobs_cost.py --benchmark-only -s
"""
import json
import os
import subprocess
import sys

COST_SCRIPT = r"""
import dataclasses, json, statistics, sys, time, torch
import kernels
from rcgrpo.config import parse_args
from rcgrpo.models import load_tokenizer, resolve_model_folder
from rcgrpo.policy import TrainablePolicy
from rcgrpo.training.context import RunContext
from rcgrpo.training.grpo import Agreement, accumulate_gradients, trainer_logprobs
from rcgrpo.training.losses import RLLossSettings
from benchmarks.test_train_step import fixed_batch
rounds = int(sys.argv[1])
folder = resolve_model_folder(None)
cfg = parse_args(["--fused", "--run.micro_batch_tokens", "4096", "--run.tensorboard", "false"], check_files=False)
tokenizer = load_tokenizer(folder)
ctx = RunContext(cfg, torch.device("cpu"), tokenizer, folder)
policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=False)
batch = fixed_batch(tokenizer)
batch = dataclasses.replace(batch, advantages=kernels.group_advantages(batch.rewards, batch.seq_group))
# Engine log-probs near the trainer's (a realistic bf16-sized mismatch), so TIS weights vary.
own = trainer_logprobs(ctx, policy, batch, 1.0)
noise = 0.05 * torch.randn(own.shape, generator=torch.Generator().manual_seed(0))
with_engine = dataclasses.replace(batch, engine_logp=torch.where(batch.loss_mask, own + noise, torch.zeros_like(own)))
settings = RLLossSettings(beta=0.0)
variants = {
    "plain": lambda: accumulate_gradients(ctx, policy, batch, settings),
    "agreement": lambda: accumulate_gradients(ctx, policy, with_engine, settings, agreement=Agreement()),
    "tis": lambda: accumulate_gradients(ctx, policy, with_engine, settings, tis_cap=2.0, agreement=Agreement()),
}
policy.train_mode()
times = {k: [] for k in variants}
losses = {}
for r in range(rounds + 1):  # round 0 warms the allocator and the kernels up
    for name, run in variants.items():
        for p in policy.trainable_parameters():
            p.grad = None
        t0 = time.perf_counter()
        out = run()
        if r:
            times[name].append(time.perf_counter() - t0)
        losses[name] = out["loss"]
med = {k: statistics.median(v) for k, v in times.items()}
print(json.dumps({"seconds": med, "all_seconds": times, "tokens": batch.num_tokens,
                  "loss_tokens": batch.num_loss_tokens, "losses": losses}))
"""


def run_cost(rounds: int) -> dict:
    env = dict(os.environ, RCGRPO_PROGRESS="0")
    out = subprocess.run([sys.executable, "-c", COST_SCRIPT, str(rounds)], capture_output=True, text=True,
                         timeout=3600, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_logprobs_and_tis_overhead(benchmark):
    result = benchmark.pedantic(lambda: run_cost(3), rounds=1, iterations=1)
    sec = result["seconds"]
    tokens = result["tokens"]
    ratios = {k: sec[k] / sec["plain"] for k in ("agreement", "tis")}
    benchmark.extra_info.update(result, ratios=ratios)
    for k, s in sec.items():
        print(f"\n{k}: {tokens / s:.0f} tokens/s ({s:.2f} s per update of {tokens} tokens, "
              f"{result['loss_tokens']} loss tokens)")
    print(f"overhead vs plain: agreement {100 * (ratios['agreement'] - 1):+.1f}%, "
          f"tis {100 * (ratios['tis'] - 1):+.1f}%")
    # Same gradients' loss without TIS; TIS reweights it.
    assert abs(result["losses"]["agreement"] - result["losses"]["plain"]) < 1e-6
    assert ratios["agreement"] < 1.03 and ratios["tis"] < 1.03
