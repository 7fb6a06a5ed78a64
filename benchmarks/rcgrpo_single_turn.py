"""rcgrpo's side of ``benchmarks/test_vs_trl.py``: the trainer's own pieces
as ``train_rl`` runs them per step (weights into the in-process vLLM engine,
``run_episodes``, ``rl_update`` with the fused chunked loss), on the work of
``benchmarks.single_turn``. Micro-batches of one prompt group each: the
prompt forwarded once, then its G replies.

    python -m benchmarks.rcgrpo_single_turn OUT_DIR    (env BENCH_GC=true|false, BENCH_THREADS)

prints one JSON line: per-step times, rewards and token counts, and the
process's peak RSS (VmHWM).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch

from benchmarks import single_turn as work
from benchmarks.fresh_process import status_bytes


def reply(rollout) -> str:
    return next(m["content"] for m in rollout.messages if m["role"] == "assistant")


def main(out_dir: str) -> dict:
    from rcgrpo.config import parse_args
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
    from rcgrpo.model.policy import TrainablePolicy
    from rcgrpo.rollout import make_engine
    from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
    from rcgrpo.rollout.engine import awake
    from rcgrpo.training.losses import RLLossSettings
    from rcgrpo.training.optimizer import make_optimizer
    from rcgrpo.training.rl_update import UpdateSettings, rl_update, to_trajectories
    from rcgrpo.training.step_settings import StepSettings

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    folder = resolve_model_folder(None)
    cfg = parse_args(["--fused", "--out-dir", out_dir, "--name", "bench", "--run.report_to", "none",
                      "--run.micro_batch_tokens", str(work.MICRO_BATCH_TOKENS),
                      "--model.gradient_checkpointing", os.environ.get("BENCH_GC", "true")], check_files=False)
    tok = load_tokenizer(folder)
    jobs = work.entries()
    engine = make_engine("vllm", folder, dtype="float32", max_model_len=8192, seed=0, kv_cache_gib=1)
    policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=False)
    how = StepSettings.from_config(cfg, torch.device("cpu"))
    opt, sched = make_optimizer(policy, work.LR, 0.0, work.STEPS, 0.0)
    settings = RLLossSettings(beta=0.0, loss_type="grpo")
    steps = []
    for step in range(work.STEPS):
        t0 = time.perf_counter()
        policy.eval_mode()
        with awake(engine, policy.rollout_weights()) as live:
            rollouts = run_episodes(live, tok, jobs, work.G, RolloutConfig(
                max_new_tokens=work.MAX_NEW, max_total_tokens=8192, doc_style=work.DOC_STYLE, seed=step,
                progress=False), reward_tokens=None, episode_factory=work.single_reply_episode)
        # The benchmark's reward (single_turn.reward): the episode's own plus the reply's tie-break.
        rollouts = [dataclasses.replace(r, reward=r.reward + work.tie_break(reply(r))) for r in rollouts]
        t1 = time.perf_counter()
        policy.train_mode()
        stats = rl_update(policy, to_trajectories(rollouts), how, settings, UpdateSettings(), optimizer=opt,
                          scheduler=sched, step=step)
        t2 = time.perf_counter()
        steps.append({"generation_s": t1 - t0, "update_s": t2 - t1, "total_s": t2 - t0,
                      "reward_mean": sum(r.reward for r in rollouts) / len(rollouts),
                      "update_skipped": stats["update_skipped"],
                      "generated": sum(sum(r.sampled_mask) for r in rollouts),
                      "batch_tokens": stats.get("batch_tokens", 0), "forward_tokens": stats.get("forward_tokens", 0)})
    # VmHWM, not ru_maxrss: after fork + exec, ru_maxrss also counts the parent's pages at the fork
    return {"steps": steps, "peak_rss_mb": status_bytes("VmHWM:") / (1 << 20),
            "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
