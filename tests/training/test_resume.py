"""A training run killed in the middle of a checkpoint save resumes from the
newest complete checkpoint, ends with exactly the weights of a run that was
never interrupted, and its metrics continue from the right step.

The kill is a real SIGKILL of the trainer process at a chosen line of the save
(tests/crashpoints.py), not after a fixed delay; every line of the save is
covered at the checkpoint level by tests/run/test_checkpoint.py."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.data.rctp import save_records
from rcgrpo.model.loading import folder_weights
from tests.training.conftest import chat_record, save_tiny_llama

pytestmark = pytest.mark.slow  # trainer subprocesses, one SIGKILLed mid-save (~17 s)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
SAVE_EVERY = 2  # checkpoints at steps 2 and 4


def train_args(data, model, out, name):
    return ["--fused", "--model", str(model), "--stages", "rctp-data,rctp", "--rctp.data_file", str(data),
            "--rctp.batch_size", "1", "--rctp.epochs", "1", "--rctp.lr", "1e-3",
            "--run.checkpoint_every", str(SAVE_EVERY), "--run.keep_last", "2", "--out-dir", str(out), "--name", name,
            # The stage trains on the data file; one named entry spares tokenizing 720 prompts per launch.
            "--data.entry_ids", "multi_turn_base_1"]


def run(args, crash=None):
    env = dict(os.environ, RCGRPO_PROGRESS="0", PYTHONPATH=str(ROOT))
    prefix = ["-m", "tests.crashpoints", "train", *crash, "--"] if crash else ["-m", "rcgrpo.train"]
    return subprocess.run([sys.executable, *prefix, *args], env=env, cwd=ROOT, capture_output=True, text=True)


def weights(folder):
    return dict(folder_weights(folder))


def test_killed_mid_save_resumes_from_the_newest_complete_checkpoint(tmp_path, tokenizer):
    records = [
        chat_record(tokenizer, f"List the files, request {i}.", "[ls(a=True)]" if i % 2 else "[pwd()]",
                    HIGH_REWARD if i % 2 else LOW_REWARD, float(i % 2))
        for i in range(STEPS)
    ]
    data = save_records(records, tmp_path / "tiny.jsonl")
    model = save_tiny_llama(tmp_path / "tiny-llama", tokenizer)
    runs = tmp_path / "runs"

    whole = run(train_args(data, model, runs, "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]

    # Killed in the save of step 4, after its folder is complete and before
    # the rename that makes it a checkpoint.
    killed = run(train_args(data, model, runs, "killed"), crash=["2", "os.rename(tmp, final)"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = runs / "killed" / "checkpoints" / "rctp"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("ckpt")) == ["ckpt-00000002",
                                                                                     "ckpt-00000004.tmp"]

    resumed = run(train_args(data, model, runs, "killed") + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stderr + resumed.stdout
    assert "ckpt-00000004.tmp was complete" in log and "resumed from" in log and "(step 4)" in log

    # At the step it resumed from, and at the end, it equals the uninterrupted run.
    at_4 = weights(runs / "whole" / "checkpoints" / "rctp" / "ckpt-00000004" / "model")
    for name, tensor in weights(ckpts / "ckpt-00000004" / "model").items():
        assert torch.equal(tensor, at_4[name]), name
    final = weights(runs / "whole" / "models" / "rctp")
    for name, tensor in weights(runs / "killed" / "models" / "rctp").items():
        assert torch.equal(tensor, final[name]), name

    rows = [json.loads(line) for line in (runs / "killed" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if r["stage"] == "rctp"] == list(range(1, STEPS + 1))  # each step once
    assert (runs / "killed" / "stages" / "rctp.done").exists()
