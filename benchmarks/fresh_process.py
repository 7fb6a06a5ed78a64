"""Run a benchmark program (``python -m benchmarks.<name>``) in a fresh
process: its own allocator, its own peak RSS (``ru_maxrss``), no caches
shared with the session. The program prints one JSON object as its last
line of output; that object is the measurement.

A watchdog kills the child if the machine's available memory drops under
``min_available`` (a shared machine is never pushed into the OOM killer)
or the time limit passes; the caller gets ``None`` then, not a hang.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
# The largest resident memory this process and a running benchmark program
# held together, sampled every 0.5 s (the session's peak on the machine).
TREE_PEAK = {"bytes": 0}


def mem_available() -> int:
    """MemAvailable in bytes (/proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def status_bytes(field: str, pid: str = "self") -> int:
    """A /proc/<pid>/status size field (VmRSS:, VmHWM:) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def child_env(**extra: str) -> dict:
    """This session's environment for a child: the repository importable,
    progress bars off, vLLM in-process; `extra` on top."""
    env = dict(os.environ, RCGRPO_PROGRESS="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def run_module(module: str, *args: str, env: dict | None = None, timeout: float = 3600,
               min_available: int = GIB) -> dict | None:
    """``python -m module args...`` from the repository root; its last output
    line parsed as JSON, or None if the watchdog stopped it. A failing child
    raises with the tail of its stderr."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    with open(os.devnull, "rb") as stdin:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env if env is not None else child_env(), cwd=ROOT)
        # Drained by communicate(); a poll loop alone could fill the pipes and stall the child.
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                try:
                    both = status_bytes("VmRSS:") + status_bytes("VmRSS:", str(proc.pid))
                    TREE_PEAK["bytes"] = max(TREE_PEAK["bytes"], both)
                except OSError:  # the child has just exited
                    pass
                if mem_available() < min_available or time.monotonic() > deadline:
                    proc.kill()
                    proc.communicate()
                    return None
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(map(str, args))} exited {proc.returncode}:\n"
                           f"{err[-4000:]}")
    lines = out.strip().splitlines()
    if not lines:
        raise RuntimeError(f"python -m {module} printed nothing; stderr:\n{err[-4000:]}")
    return json.loads(lines[-1])
