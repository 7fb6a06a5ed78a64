"""One RC-GRPO update of the small model on a fixed packed batch, through the
trainer's own path (``accumulate_gradients``: token-balanced micro-batches,
the loss, backward; then the AdamW step), in this fresh process.

    python -m benchmarks.update_step VARIANT [BATCH]

VARIANT: ``reference`` (full logits), ``fused`` (the chunked fused-linear
loss, shared prompt prefixes forwarded once: the default) or
``fused-dense`` (fused, every sequence forwarded whole:
``--model.share_prefixes false``); gradient checkpointing on for all
three (``CHECKPOINTING``). Prints one JSON line: the update's
seconds, its peak memory above the loaded model and batch (VmHWM after
resetting the high-water mark), the process's peak RSS (VmHWM), the loss,
the token counts and the micro-batches.

BATCH (``BATCHES``), real BFCL prompts both:

- ``group`` (the default): one group of an expert and a perturbed-expert
  trajectory of a training entry, played through the agent loop and
  labelled by the environment (rewards differ, so advantages are
  non-zero). Smoke size keeps the last 192 prompt tokens (the same in both:
  the group still shares them) and the first 64 positions after them.
- ``rl-groups``: an RC-GRPO step of the default run (cpu-small): G
  rollouts of each of its two training entries, the reward token drawn per
  rollout, replies of seeded random ids and lengths (the run's rollouts
  average ~210 tokens after the prompt, a quarter of them sampled). Each
  group shares its prompt up to the tag, the two groups the 149-token
  preamble. G = 4 (the run's) in the full sweep, 2 at quick size (the dense
  update's ~4x cost fits the session); smoke, G = 2, each prompt cut to its
  first 160 and last 32 tokens, replies of 8-24.
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
    from rcgrpo.data.expert import expert_turns, perturbed_turns, play_script, script_from_turns
    from rcgrpo.envs.bfcl import load_entries, split_train_test
    from rcgrpo.model.packing import Trajectory, pack
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


RL_ENTRIES = ("multi_turn_base_100", "multi_turn_base_104")  # cpu-small's data.entry_ids


def rl_groups_batch(tokenizer):
    """The default run's RC-GRPO step, with random replies (module docstring)."""
    import random

    from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
    from rcgrpo.conditioning.reward_tokens import DrawPerRollout, rollout_tokens
    from rcgrpo.envs.bfcl import Episode, load_entries
    from rcgrpo.model.packing import Trajectory, pack

    group_size, cut, replies = scale.pick(smoke=(2, (160, 32), (8, 24)), quick=(2, None, (105, 315)),
                                           full=(4, None, (105, 315)))
    entries = {e.id: e for e in load_entries(["base"])}
    chat = ChatTokens(tokenizer)
    rng = random.Random(0)
    tags = rollout_tokens(DrawPerRollout(0.5), len(RL_ENTRIES) * group_size, rng)
    trajs = []
    for group, entry_id in enumerate(RL_ENTRIES):
        for k in range(group_size):
            episode = Episode(entries[entry_id])
            prompt = chat.prompt_ids(initial_messages(episode, tags[group * group_size + k], "compact_no_response"))
            if cut is not None:
                prompt = prompt[:cut[0]] + prompt[-cut[1]:]
            n = rng.randint(*replies)
            reply = [rng.randrange(200, len(tokenizer) - 2) for _ in range(n)]
            # A quarter sampled, as in the run (~50 of ~210): a first and a last
            # assistant turn around a tool's output.
            sampled = [1] * (n // 8) + [0] * (n - 2 * (n // 8)) + [1] * (n // 8)
            trajs.append(Trajectory(prompt + reply, [0] * len(prompt) + sampled, group=group, reward=float(k % 2)))
    return pack(trajs)


BATCHES = {"group": fixed_batch, "rl-groups": rl_groups_batch}


def main(variant: str, batch_name: str = "group") -> dict:
    import rcgrpo_kernels
    from rcgrpo.config import parse_args
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
    from rcgrpo.model.micro_batching import micro_batch_plan
    from rcgrpo.model.policy import TrainablePolicy
    from rcgrpo.training.losses import RLLossSettings
    from rcgrpo.training.optimizer import make_optimizer
    from rcgrpo.training.rl_update import accumulate_gradients
    from rcgrpo.training.step_settings import StepSettings

    folder = resolve_model_folder(None)
    cfg = parse_args(VARIANTS[variant] + CHECKPOINTING + ["--run.micro_batch_tokens", str(MICRO_BATCH_TOKENS),
                                                          "--run.report_to", "none"], check_files=False)
    tokenizer = load_tokenizer(folder)
    how = StepSettings.from_config(cfg, torch.device("cpu"))
    policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=True)
    batch = BATCHES[batch_name](tokenizer)
    batch = dataclasses.replace(batch, advantages=rcgrpo_kernels.group_advantages(batch.rewards, batch.seq_group))
    opt, _ = make_optimizer(policy, 1e-6, 0.0, 1, 0.0)
    policy.train_mode(dropout=False)
    process_peak = status_bytes("VmHWM:")  # loading's peak, before the reset below
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS: the peak counted is the update's own
    base = status_bytes("VmRSS:")
    t0 = time.perf_counter()
    stats = accumulate_gradients(policy, batch, how, RLLossSettings(beta=BETA))
    opt.step()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "update_peak_gib": (status_bytes("VmHWM:") - base) / GIB,
            "process_peak_gib": max(process_peak, status_bytes("VmHWM:")) / GIB,
            "loss": stats["loss"], "seqs": batch.num_seqs, "tokens": batch.num_tokens,
            "loss_tokens": batch.num_loss_tokens, "forward_tokens": stats["forward_tokens"],
            "micro_batches": len(micro_batch_plan(batch, MICRO_BATCH_TOKENS, policy.lm.shares_prefixes))}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
