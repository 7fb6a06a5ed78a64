"""One RC-GRPO step on the shipped arithmetic environment (rcgrpo/envs/
arithmetic_tools.py: reasoning-gym's tasks and scorer, solved with a
calculator and submit_answer), through the trainer itself
(``python -m rcgrpo.train --env arithmetic``) from the embedded 135M model,
fp32 on CPU, fused loss, shared prefixes, each run in a fresh process.

Two runs:
- untrained: ``--stages rc-grpo`` from the base model, its reward probe
  before the first step under each reward token (the sampled reward of the
  untrained model on the probe's training tasks, temperature 1);
- the step: a short RCTP first (references and near misses of the same
  tasks, 3 epochs), so that the step's groups have reward variance and the
  update really runs; then 2 RC-GRPO steps, the second one timed (the first
  also pays the once-per-stage tree-parity check, reported apart).

Sizes (``benchmarks/scale.py``): quick, 8 tasks x G 8 (64 rollouts, the
issue's size), 64 probe rollouts per token; smoke, 2 tasks x G 2, 2 probe
rollouts, 1 RCTP epoch. Target: the step (rollouts + update) <= 60 s.
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
RCTP_EPOCHS = scale.pick(smoke=1, quick=3)
pytestmark = pytest.mark.benchmark(group="environments: one RC-GRPO step on arithmetic")
ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--env", "arithmetic", "--data.train_subset", str(TASKS), "--grpo.batch_size", str(TASKS),
          "--grpo.group_size", str(G), "--fused", "--report-to", "none"]


def _run(out: Path, name: str, *flags: str) -> list[dict]:
    argv = [sys.executable, "-m", "rcgrpo.train", "--out-dir", str(out), "--name", name, *COMMON, *flags]
    proc = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("stage") == "rc-grpo"]


def test_one_rc_grpo_step_on_arithmetic(benchmark, board, tmp_path):
    untrained = _run(tmp_path, "untrained", "--stages", "rc-grpo", "--grpo.steps", "1", "--grpo.eval_every", "1",
                     "--grpo.eval_rollouts", str(PROBE))
    step0 = next(r for r in untrained if r["step"] == 0)
    records = {}

    def once():
        records["rows"] = _run(tmp_path, "step", "--stages", "rctp-data,rctp,rc-grpo", "--rctp.epochs",
                               str(RCTP_EPOCHS), "--grpo.steps", "2", "--grpo.eval_every", "0")

    benchmark.pedantic(once, rounds=1, iterations=1, warmup_rounds=0)
    first, second = (next(r for r in records["rows"] if r["step"] == s) for s in (1, 2))
    shape = f"cpu fp32 135M, {TASKS} tasks x G {G}, fused, shared prefixes"
    benchmark.extra_info.update(rollout_s=second["rollout_s"], update_s=second["update_s"],
                                reward_mean=second.get("reward_mean"), batch_tokens=second.get("batch_tokens"),
                                untrained_high=step0["sampled_reward_high"], untrained_low=step0["sampled_reward_low"])
    board.record(Figure(group="environments", name="one RC-GRPO step on arithmetic: rollouts + update",
                        value=second["rollout_s"] + second["update_s"], unit="s", shape=shape, max_value=60.0))
    board.record(Figure(group="environments", name="  rollouts", value=second["rollout_s"], unit="s", shape=shape))
    board.record(Figure(group="environments", name="  update", value=second["update_s"], unit="s", shape=shape))
    board.record(Figure(group="environments", name="  first step's tree-parity check (once per stage)",
                        value=first.get("tree_parity_s", 0.0), unit="s", shape=shape))
    for tag in ("high", "low"):
        board.record(Figure(group="environments", name=f"untrained sampled reward under <|{tag}_reward|>",
                            value=step0[f"sampled_reward_{tag}"], unit="", shape=f"{PROBE} rollouts, T 1"))
