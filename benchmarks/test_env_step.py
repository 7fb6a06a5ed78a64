"""One RC-GRPO step on the shipped arithmetic environment (rcgrpo/envs/
arithmetic_tools.py: reasoning-gym's tasks and scorer, solved with a
calculator and submit_answer), through the trainer itself:
``python -m rcgrpo.train --env arithmetic --stages rc-grpo`` from the
embedded 135M model, fp32 on CPU, in a fresh process.

Sizes (``benchmarks/scale.py``): quick, 8 tasks x G 8 (64 rollouts, the
issue's size) and 64 probe rollouts per reward token; smoke, 2 tasks x G 2
and 2 probe rollouts.

Rows: the step's time, rollouts + update (target <= 60 s at quick size),
each part reported; the sampled reward before any training under each reward
token (the reward probe's step-0 record: the untrained model on the probe's
training tasks, temperature 1).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import scale
from benchmarks.scoreboard import Figure

TASKS = scale.pick(smoke=2, quick=8)
G = scale.pick(smoke=2, quick=8)
PROBE = scale.pick(smoke=2, quick=64)
pytestmark = pytest.mark.benchmark(group="environments: one RC-GRPO step on arithmetic")
ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path) -> list[dict]:
    argv = [sys.executable, "-m", "rcgrpo.train", "--env", "arithmetic", "--stages", "rc-grpo",
            "--out-dir", str(out), "--name", "step", "--grpo.batch_size", str(TASKS), "--grpo.group_size", str(G),
            "--grpo.steps", "1", "--grpo.eval_every", "1", "--grpo.eval_rollouts", str(PROBE),
            "--data.train_subset", str(max(TASKS, PROBE)), "--fused", "--report-to", "none"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "step" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_one_rc_grpo_step_on_arithmetic(benchmark, board, tmp_path):
    records = {}

    def once():
        records["rows"] = _run(tmp_path / "runs")

    benchmark.pedantic(once, rounds=1, iterations=1, warmup_rounds=0)
    rows = records["rows"]
    step0 = next(r for r in rows if r.get("step") == 0)
    step1 = next(r for r in rows if r.get("step") == 1 and "rollout_s" in r)
    shape = f"cpu fp32 135M, {TASKS} tasks x G {G}, fused, shared prefixes"
    benchmark.extra_info.update(rollout_s=step1["rollout_s"], update_s=step1["update_s"],
                                reward_mean=step1.get("reward_mean"), high=step0.get("sampled_reward_high"),
                                low=step0.get("sampled_reward_low"))
    board.record(Figure(group="environments", name="one RC-GRPO step on arithmetic: rollouts + update",
                        value=step1["rollout_s"] + step1["update_s"], unit="s", shape=shape, max_value=60.0))
    board.record(Figure(group="environments", name="  rollouts", value=step1["rollout_s"], unit="s", shape=shape))
    board.record(Figure(group="environments", name="  update", value=step1["update_s"], unit="s", shape=shape))
    for tag in ("high", "low"):
        board.record(Figure(group="environments", name=f"untrained sampled reward under <|{tag}_reward|>",
                            value=step0[f"sampled_reward_{tag}"], unit="", shape=f"{PROBE} rollouts, T 1"))
