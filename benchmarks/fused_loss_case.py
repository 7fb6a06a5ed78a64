"""One CPU measurement of the fused-linear GRPO loss, in a fresh process.

    python -m benchmarks.fused_loss_case '["chunked", 896, 151936, 2048, 0.25]'

prints one JSON line: the forward+backward's wall time and its peak memory
above the inputs (VmHWM - VmRSS just before the call, after resetting the
high-water mark with ``echo 5 > /proc/self/clear_refs``; the weight gradient
counts). ``benchmarks/test_kernels.py`` starts one per measurement. The
inputs and the callables of each path are ``scripts/fused_loss_case.py``'s,
which ``scripts/gpu_check.py`` uses too.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from benchmarks.fresh_process import GIB, status_bytes
from scripts.fused_loss_case import make_fn, make_inputs


def expected_peak(path, hdim, vocab, n):
    """Rough upper bound of a CPU path's peak in bytes (fp32), for the memory guard."""
    wgrad = 4 * vocab * hdim
    if path == "reference":
        # logits / log-softmax / their grads: measured 3.0 copies of [N, V] fp32
        # (3.50 GiB at N=2048, V=151,936)
        return 3.1 * 4 * n * vocab + 2 * wgrad
    if path == "liger":
        return 3 * wgrad + 4 * 2048 * 4096 * 4
    return 2 * wgrad + 2 * 4 * 256 * vocab  # chunked: fp32 weight grad + chunk buffer


def measure(path, hdim, vocab, n, frac):
    """One CPU forward+backward in this (fresh) process: its time and peak."""
    torch.set_num_threads(os.cpu_count() or 1)
    x = make_inputs(hdim, vocab, n, frac, torch.float32, "cpu")
    fn = make_fn(path, x)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = status_bytes("VmRSS:")
    t0 = time.perf_counter()
    loss = fn()
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM:") - base
    return dict(time_s=seconds, peak_gib=peak / GIB, loss=float(loss))


if __name__ == "__main__":
    print(json.dumps(measure(*json.loads(sys.argv[1]))))
