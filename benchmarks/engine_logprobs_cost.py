"""What keeping the engine's log-probs costs the fused update: the
engine/trainer agreement (one LM-head pass over the loss rows, from the
hidden states the loss pass already has) and truncated importance sampling
on top, against the plain fused update, on ``benchmarks.update_step``'s
batch (the 135M model, fp32, ``--fused``).

    python -m benchmarks.engine_logprobs_cost ROUNDS

times the three variants alternating round by round (so that they share the
machine's state; round 0 warms up and is not counted) and prints one JSON
line: the median seconds of each, every round's, the token counts and the
losses. beta = 0 keeps the reference forward (the same for every variant)
out of the timing, so the overhead is measured against the smallest update.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import torch

from benchmarks.update_step import fixed_batch


def main(rounds: int) -> dict:
    import rcgrpo_kernels
    from rcgrpo.config import parse_args
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
    from rcgrpo.model.policy import TrainablePolicy
    from rcgrpo.training.agreement import Agreement
    from rcgrpo.training.losses import RLLossSettings
    from rcgrpo.training.rl_update import accumulate_gradients, trainer_logprobs
    from rcgrpo.training.step_settings import StepSettings

    folder = resolve_model_folder(None)
    cfg = parse_args(["--fused", "--run.micro_batch_tokens", "4096", "--run.report_to", "none"],
                     check_files=False)
    tokenizer = load_tokenizer(folder)
    how = StepSettings.from_config(cfg, torch.device("cpu"))
    policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=False)
    batch = fixed_batch(tokenizer)
    batch = dataclasses.replace(batch, advantages=rcgrpo_kernels.group_advantages(batch.rewards, batch.seq_group))
    # Engine log-probs near the trainer's (a realistic bf16-sized mismatch), so TIS weights vary.
    own = trainer_logprobs(policy, batch, how, 1.0)
    noise = 0.05 * torch.randn(own.shape, generator=torch.Generator().manual_seed(0))
    with_engine = dataclasses.replace(batch, engine_logp=torch.where(batch.loss_mask, own + noise,
                                                                     torch.zeros_like(own)))
    settings = RLLossSettings(beta=0.0)
    variants = {
        "plain": lambda: accumulate_gradients(policy, batch, how, settings),
        "agreement": lambda: accumulate_gradients(policy, with_engine, how, settings, agreement=Agreement()),
        "tis": lambda: accumulate_gradients(policy, with_engine, how, settings, tis_cap=2.0, agreement=Agreement()),
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
    return {"seconds": {k: statistics.median(v) for k, v in times.items()}, "all_seconds": times,
            "tokens": batch.num_tokens, "loss_tokens": batch.num_loss_tokens, "losses": losses}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
