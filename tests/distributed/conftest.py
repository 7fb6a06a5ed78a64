"""Multi-process tests on CPU (gloo): torchrun launches real ranks of the
small model. Each process runs with one thread; the machine has two cores."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", RCGRPO_PROGRESS="0", PYTHONPATH=str(ROOT))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(var, None)  # a test run inside torchrun must not leak its world
    # Set by this session's in-process engine (tests/conftest.py, VLLMEngine):
    # a job's engines take the KV cache their own arguments ask for, as when
    # this folder runs alone (2 ranks x 1 GiB, not 2 x 2).
    e.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # Likewise the log level: a job's engines choose their own, as a user's run would.
    e.pop("VLLM_LOGGING_LEVEL", None)
    return e


# `timeout`: tests pass none (no test has a wall-clock limit);
# benchmarks/test_distributed.py bounds its long jobs with one.
def torchrun(nproc: int, args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node nproc args...` (a free port per job)."""
    cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}"] + args
    return subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def python(args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable] + args, env=env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
