"""A training run killed mid-stage resumes from its latest good checkpoint,
finishes, and its metrics continue from the right step."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rcgrpo.data.rctp import save_records
from rcgrpo.models import HIGH_REWARD, LOW_REWARD

from tests.training.conftest import chat_record

STEPS = 6  # every checkpoint of the 135M model + AdamW is ~1.6 GB: keep them few


def train_cmd(data, out):
    return [sys.executable, "-m", "rcgrpo.train", "--fused", "--stages", "rctp-data,rctp",
            "--rctp.data_file", str(data), "--rctp.batch_size", "1", "--rctp.epochs", "1",
            "--run.checkpoint_every", "2", "--run.keep_last", "2", "--out-dir", str(out), "--name", "resume"]


def test_killed_run_resumes_and_metrics_continue(tmp_path, tokenizer):
    records = [
        chat_record(tokenizer, f"List the files, request {i}.", "[ls(a=True)]" if i % 2 else "[pwd()]",
                    HIGH_REWARD if i % 2 else LOW_REWARD, float(i % 2))
        for i in range(STEPS)
    ]
    data = save_records(records, tmp_path / "tiny.jsonl")
    run_dir = tmp_path / "runs" / "resume"
    env = dict(os.environ, RCGRPO_PROGRESS="0")
    proc = subprocess.Popen(train_cmd(data, tmp_path / "runs"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    ckpts = run_dir / "checkpoints" / "rctp"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if list(ckpts.glob("ckpt-*[0-9]")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    killed_at = max(r["step"] for r in before if r["stage"] == "rctp")
    assert 0 < killed_at < STEPS

    done = subprocess.run(train_cmd(data, tmp_path / "runs") + ["--resume"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr + done.stdout
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r["step"] for r in rows if r["stage"] == "rctp"]
    assert steps == list(range(1, STEPS + 1)), steps  # each step once, in order
    assert (run_dir / "models" / "rctp" / "model.safetensors").exists()
    assert (run_dir / "stages" / "rctp.done").exists()
