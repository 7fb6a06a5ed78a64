"""Multi-process tests on CPU (gloo): torchrun launches real ranks of the
small model. Each process runs with one thread; the machine has two cores."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", RCGRPO_PROGRESS="0", PYTHONPATH=str(ROOT))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(var, None)  # a test run inside torchrun must not leak its world
    return e


def torchrun(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node nproc args...` (a free port per job)."""
    cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}"] + args
    return subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True)


def python(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable] + args, env=env(), cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="session")
def model_dir():
    from rcgrpo.models import resolve_model_folder

    return resolve_model_folder(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from rcgrpo.models import load_tokenizer

    return load_tokenizer(model_dir)
