"""A checkpoint written by a 2-rank torchrun job (FSDP state gathered to
rank 0, the one-process format) resumes in a plain 1-process run, and that
run ends where the 2-rank run ended: same weights after the same steps."""
import json
import shutil

import pytest
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.data.rctp import save_records
from tests.distributed.conftest import python, torchrun
from tests.training.conftest import chat_record

# torchrun: 2 ranks train the tiny model (tests/conftest.py, tiny_folder: the checkpoint's format and
# resume are the subject, not the model), then 1 process resumes (~52 s on a busy
# 2-core machine, where each process spends most of it importing)
pytestmark = pytest.mark.slow

LR = 1e-4


def train_args(data, model, out):
    # 4 trajectories, 2 per step: 2 steps, a checkpoint after step 1.
    return ["-m", "rcgrpo.train", "--fused", "--model", str(model), "--stages", "rctp-data,rctp",
            "--rctp.data_file", str(data),
            "--rctp.batch_size", "2", "--rctp.epochs", "1", "--rctp.lr", str(LR), "--run.checkpoint_every", "1",
            "--run.keep_last", "1", "--out-dir", str(out), "--name", "ws", "--run.report_to", "none",
            # Short records: a small micro-batch keeps the memory plan of 2
            # ranks sharing this 24 GB host within it.
            "--run.micro_batch_tokens", "1024",
            # The stage trains on the data file; one named entry spares tokenizing the prompts in each process.
            "--data.entry_ids", "multi_turn_base_1"]


def test_two_rank_checkpoint_resumes_in_one_process(tmp_path, tokenizer, tiny_folder):
    from safetensors.torch import load_file

    records = [chat_record(tokenizer, f"List the files, request {i}.", "[ls(a=True)]" if i % 2 else "[pwd()]",
                           HIGH_REWARD if i % 2 else LOW_REWARD, float(i % 2)) for i in range(4)]
    data = save_records(records, tmp_path / "tiny.jsonl")
    run_dir = tmp_path / "runs" / "ws"

    two = torchrun(2, train_args(data, tiny_folder, tmp_path / "runs"))
    assert two.returncode == 0, two.stderr[-3000:]
    ckpt = run_dir / "checkpoints" / "rctp" / "ckpt-00000001"
    assert (ckpt / "MANIFEST.json").is_file() and (ckpt / "model" / "model.safetensors").is_file()
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert all(isinstance(k, int) for k in optim["state"])  # optimizer.state_dict()'s own format
    final_two = tmp_path / "final-two"
    shutil.move(run_dir / "models" / "rctp", final_two)
    (run_dir / "stages" / "rctp.done").unlink()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "rctp"] == [1, 2]  # rank 0 alone wrote them

    one = python(train_args(data, tiny_folder, tmp_path / "runs") + ["--resume"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed from" in one.stderr and "ckpt-00000001" in one.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "rctp"] == [1, 2]
    before = load_file(str(ckpt / "model" / "model.safetensors"))
    a = load_file(str(final_two / "model.safetensors"))
    b = load_file(str(run_dir / "models" / "rctp" / "model.safetensors"))
    assert a.keys() == b.keys()
    step2 = max(float((b[k].float() - before[k].float()).abs().max()) for k in b)
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert step2 > LR / 2  # step 2 did move the weights
    # Step 2 from the restored weights and Adam moments equals the 2-rank
    # step 2; with fresh moments it would differ by ~lr.
    assert diff < 0.25 * LR, f"1-process resume ends {diff} away from the 2-rank run (lr {LR})"
