"""One RC-GRPO update of the small model on a fixed packed batch, through the
trainer's own path (``accumulate_gradients``: token-balanced micro-batches,
the loss, backward; then the AdamW step), in this fresh process.

    python -m benchmarks.update_step VARIANT

VARIANT: ``reference`` (full logits), ``fused`` (the chunked fused-linear
loss, shared prompt prefixes forwarded once: the default) or
``fused-dense`` (fused, every sequence forwarded whole:
``--model.share_prefixes false``); gradient checkpointing on for all
three (``CHECKPOINTING``). Prints one JSON line: the update's
seconds, its peak memory above the loaded model and batch (VmHWM after
resetting the high-water mark), the process's peak RSS (VmHWM), the loss and the
token counts.

The batch is real BFCL data: one group of an expert and a perturbed-expert
trajectory of a training entry, played through the agent loop and labelled
by the environment (rewards differ, so advantages are non-zero). Smoke size
keeps the last 192 prompt tokens (the same in both: the group still shares
them) and the first 64 positions after them.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from benchmarks import scale
from benchmarks.fresh_process import GIB, status_bytes

VARIANTS = {"reference": [], "fused": ["--fused"], "fused-dense": ["--fused", "--model.share_prefixes", "false"]}
# cpu-small's budget: the group (~4.8k tokens forwarded once, ~8.9k whole) fits one micro-batch when shared
MICRO_BATCH_TOKENS = 8192
# On for every variant: without it one pass over the group keeps ~7-8 GiB of
# activations, which hides the LM head's share (what the fused loss saves)
# and pushes the benchmark session past 10 GB.
CHECKPOINTING = ["--model.gradient_checkpointing", "true"]
BETA = 0.1


def fixed_batch(tokenizer):
    """Expert + perturbed trajectories of one base entry (one group)."""
    from rcgrpo.batch import Trajectory, pack
    from rcgrpo.data.expert import expert_turns, perturbed_turns, play_script, script_from_turns
    from rcgrpo.envs.bfcl import load_entries, split_train_test
    from rcgrpo.rollout.agent_loop import RolloutConfig

    train, _ = split_train_test(load_entries(["base"]))
    cfg = RolloutConfig(max_new_tokens=1024, max_total_tokens=6144, doc_style="compact_no_response", progress=False)
    cut = scale.pick(smoke=(192, 64), quick=None)
    trajs = []
    for group, entry in enumerate(train[:1]):
        for turns in (expert_turns(entry), perturbed_turns(entry, "dropped", 0)):
            r = play_script(entry, tokenizer, script_from_turns(turns), cfg)
            ids, mask = list(r.token_ids), list(r.sampled_mask)
            if cut is not None:
                first = mask.index(1)
                span = slice(max(0, first - cut[0]), first + cut[1])
                ids, mask = ids[span], mask[span]
            trajs.append(Trajectory(ids, mask, group=group, reward=r.reward))
    return pack(trajs)


def main(variant: str) -> dict:
    import rcgrpo_kernels
    from rcgrpo.config import parse_args
    from rcgrpo.models import load_tokenizer, resolve_model_folder
    from rcgrpo.policy import TrainablePolicy
    from rcgrpo.training.context import RunContext
    from rcgrpo.training.grpo import accumulate_gradients
    from rcgrpo.training.losses import RLLossSettings
    from rcgrpo.training.optimizer import make_optimizer

    folder = resolve_model_folder(None)
    cfg = parse_args(VARIANTS[variant] + CHECKPOINTING + ["--run.micro_batch_tokens", str(MICRO_BATCH_TOKENS),
                                                          "--run.report_to", "none"], check_files=False)
    tokenizer = load_tokenizer(folder)
    ctx = RunContext(cfg, torch.device("cpu"), tokenizer, folder)
    policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=True)
    batch = fixed_batch(tokenizer)
    batch = dataclasses.replace(batch, advantages=rcgrpo_kernels.group_advantages(batch.rewards, batch.seq_group))
    opt, _ = make_optimizer(policy, 1e-6, 0.0, 1, 0.0)
    policy.train_mode(dropout=False)
    process_peak = status_bytes("VmHWM:")  # loading's peak, before the reset below
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS: the peak counted is the update's own
    base = status_bytes("VmRSS:")
    t0 = time.perf_counter()
    stats = accumulate_gradients(ctx, policy, batch, RLLossSettings(beta=BETA))
    opt.step()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "update_peak_gib": (status_bytes("VmHWM:") - base) / GIB,
            "process_peak_gib": max(process_peak, status_bytes("VmHWM:")) / GIB,
            "loss": stats["loss"], "tokens": batch.num_tokens, "loss_tokens": batch.num_loss_tokens,
            "forward_tokens": stats["forward_tokens"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
