"""One RC-GRPO update on fixed rollouts, in one process or in every rank of a
torchrun job: the trainer's own functions (rank slicing, rl_update with
global counts and lock-step micro-batches, FSDP sharding of the policy and
the reference, global-norm clipping, the weight stream). Rank 0 writes the
logged statistics and the updated full weights.

    python -m tests.distributed.update_worker ROLLOUTS.jsonl OUT_DIR [COMPUTE_DTYPE [MODEL [SHARE]]]
    torchrun --nproc_per_node 2 -m tests.distributed.update_worker ROLLOUTS.jsonl OUT_DIR [COMPUTE_DTYPE [MODEL [SHARE]]]

MODEL: a token-extended model folder (default, or "": the embedded SmolLM2).
SHARE: model.share_prefixes, "true" (default: tree attention, each shared
prompt forwarded once) or "false" (every sequence forwarded whole).
Also builds the rollouts file: short real conversations of the small model's
tokenizer, G per prompt with different rewards (non-zero advantages), and
lengths that give the ranks different micro-batch counts.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

LR = 1e-4  # large enough that the update clearly moves every trained weight
MICRO_BATCH_TOKENS = 300  # rank 0's half fits one micro-batch, rank 1's needs two
GROUP_SIZE = 2


def build_rollouts(tokenizer, path: Path, groups: int = 4) -> Path:
    """`groups` prompts x GROUP_SIZE tagged conversations; later groups are
    longer, so a 2-rank split gives the ranks different micro-batch counts."""
    from rcgrpo.conditioning.prompts import ChatTokens, with_reward_goal
    from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD

    chat = ChatTokens(tokenizer)
    rows = []
    for g in range(groups):
        user = f"Request {g}: list the files in the folder" + " and then sort them" * (3 * g)
        for k in range(GROUP_SIZE):
            token = HIGH_REWARD if k % 2 == 0 else LOW_REWARD
            messages = [{"role": "system", "content": "Answer with function calls."}]
            messages += with_reward_goal([{"role": "user", "content": user}], token)
            prompt = chat.prompt_ids(messages)
            reply = "[ls(a=True)]" if k % 2 == 0 else "[cd(folder='x'), pwd()]" * (1 + g)
            reply_ids = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [chat.eot_id]
            rows.append({"token_ids": prompt + reply_ids, "sampled_mask": [0] * len(prompt) + [1] * len(reply_ids),
                         "group": g, "reward": float(k % 2 == 0)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(rollouts: str, out_dir: str, dtype: str = "float32", model_folder: str | None = None,
         share_prefixes: str = "true") -> int:
    from rcgrpo.base import distributed
    from rcgrpo.config import parse_args
    from rcgrpo.model.loading import resolve_model_folder
    from rcgrpo.model.packing import Trajectory
    from rcgrpo.model.policy import TrainablePolicy
    from rcgrpo.training.losses import RLLossSettings
    from rcgrpo.training.optimizer import clip_and_step, make_optimizer
    from rcgrpo.training.rl_update import UpdateSettings, rl_update
    from rcgrpo.training.step_settings import StepSettings

    with distributed.guarded():
        distributed.init("cpu", timeout_s=120)
        torch.manual_seed(0)
        cfg = parse_args(["--fused", "--run.micro_batch_tokens", str(MICRO_BATCH_TOKENS), "--model.dtype", dtype,
                          "--model.share_prefixes", share_prefixes], check_files=False)
        folder = resolve_model_folder(model_folder or None)
        # As a stage loads it: fp32 master weights, `dtype` compute, a frozen
        # reference; FSDP2 shards (with the mixed-precision policy) under torchrun.
        policy = TrainablePolicy.load(folder, cfg.model, torch.device("cpu"), reference=True)
        model = policy.model
        with torch.no_grad():  # a policy unlike its reference: the KL term is not zero
            model.model.norm.weight.mul_(1.05)
        policy.equals_reference = False  # weights changed outside the optimizer (TrainablePolicy says so)
        rows = [json.loads(line) for line in Path(rollouts).read_text().splitlines()]
        groups = sorted({r["group"] for r in rows})
        lo, hi = distributed.rank_slice(groups)
        mine = [Trajectory(r["token_ids"], r["sampled_mask"], group=r["group"], reward=r["reward"])
                for r in rows if r["group"] in groups[lo:hi]]
        how = StepSettings.from_config(cfg, torch.device("cpu"))
        optimizer, scheduler = make_optimizer(policy, LR, 0.0, 1, 0.0)
        policy.train_mode()
        distributed.barrier()
        t0 = time.perf_counter()  # the trainer's update phase: loss, backward, step, weight stream
        stats = rl_update(policy, mine, how, RLLossSettings(beta=0.1), UpdateSettings("group"))
        stats["grad_norm"] = clip_and_step(policy, optimizer, scheduler, 1.0)
        weights = {name: t.clone() for name, t in policy.rollout_weights()}
        stats["weight_dtypes"] = sorted({str(t.dtype) for t in weights.values()})
        stats["optimizer_dtypes"] = sorted({str(v.dtype) for st in optimizer.state.values()
                                            for k, v in st.items() if k != "step"})
        stats["update_s"] = time.perf_counter() - t0
        stats["tokens_per_s"] = stats["batch_tokens"] / stats["update_s"]
        if distributed.is_main():
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "stats.json").write_text(json.dumps(stats))
            torch.save(weights, out / "weights.pt")
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
