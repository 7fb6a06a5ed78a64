"""The figures the tree parity bounds (rcgrpo.training.parity.PARITY_BOUNDS)
are set from: max |log p_tree - log p_dense| over the loss tokens of real
BFCL sequences on the 135M model, per compute dtype and attention path, and
what a tree with one planted bug gives instead.

    python -m benchmarks.tree_parity DTYPE ATTN [CUT] [--planted]

DTYPE float32 or bfloat16 (CPU autocast, as a run computes); ATTN sdpa (run
as one SDPA call per segment) or eager (the [M, M] mask). The batch: one
base entry's expert and dropped-call trajectories, each under both reward
tokens (a group of four sharing the ~2.3k-token prompt; the two of a tag
share their replies up to the dropped call). CUT keeps the last CUT prompt
tokens and the first 4 * CUT after (eager's [N, N] scores need it; default
whole sequences). `--planted`: every branch misses the last key of its shared
prefix (the tree's visibility one short), a bug to size the bound against.
Prints one JSON line.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch


def group(tokenizer, cut: int | None):
    from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
    from rcgrpo.data.expert import expert_turns, perturbed_turns, play_script, script_from_turns
    from rcgrpo.envs.bfcl import load_entries, split_train_test
    from rcgrpo.model.packing import Trajectory, pack
    from rcgrpo.rollout.agent_loop import RolloutConfig

    train, _ = split_train_test(load_entries(["base"]))
    entry = train[0]
    cfg = RolloutConfig(max_new_tokens=1024, max_total_tokens=6144, doc_style="compact_no_response", progress=False)
    trajs = []
    for token in (HIGH_REWARD, LOW_REWARD):
        for turns in (expert_turns(entry), perturbed_turns(entry, "dropped", 0)):
            r = play_script(entry, tokenizer, script_from_turns(turns), cfg, reward_token=token)
            ids, mask = list(r.token_ids), list(r.sampled_mask)
            if cut is not None:
                first = mask.index(1)
                span = slice(max(0, first - cut), first + 4 * cut)
                ids, mask = ids[span], mask[span]
            trajs.append(Trajectory(ids, mask, group=0, reward=r.reward))
    return pack(trajs)


def one_key_short(layout):
    """The planted bug: each branch sees one key fewer of every ancestor."""
    visible = layout.visible.clone()
    ancestor = (visible > 0) & (visible < torch.iinfo(torch.int64).max)
    visible[ancestor] -= 1
    return dataclasses.replace(layout, visible=visible)


def main(dtype: str, attn: str, cut: int | None, planted: bool) -> dict:
    from rcgrpo.config import parse_args
    from rcgrpo.model import prefix_sharing
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
    from rcgrpo.model.policy import TrainablePolicy
    from rcgrpo.model.prefix_sharing import forwarded_tokens
    from rcgrpo.training.losses import LOSS_PATHS
    from rcgrpo.training.parity import parity_bound, tree_vs_dense

    folder = resolve_model_folder(None)
    cfg = parse_args(["--model.dtype", dtype, "--model.attn_implementation", attn], check_files=False)
    policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=False)
    policy.eval_mode()
    batch = group(load_tokenizer(folder), cut)
    if planted:  # the tree forward's layout (rcgrpo.model.prefix_sharing.prefix_layout builds it there)
        layout = prefix_sharing.shared_prefix_layout
        prefix_sharing.shared_prefix_layout = lambda b, **kw: one_key_short(layout(b, **kw)) if kw.get("share", True) \
            else layout(b, **kw)
    t0 = time.perf_counter()
    diff = tree_vs_dense(policy.lm, batch, LOSS_PATHS["fused"])
    return {"dtype": dtype, "attn": attn, "planted": planted, "max_abs": float(diff.max()),
            "mean_abs": float(diff.mean()), "loss_tokens": diff.numel(), "packed_tokens": batch.num_tokens,
            "tree_tokens": forwarded_tokens(batch, True), "bound": parity_bound(policy.compute_dtype)[0],
            "seconds": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--planted"]
    print(json.dumps(main(args[0], args[1], int(args[2]) if len(args) > 2 else None, "--planted" in sys.argv)))
