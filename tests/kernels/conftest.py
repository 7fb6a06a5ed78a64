"""Kernel tests run on CPU; the Triton path goes through Triton's interpreter.

TRITON_INTERPRET must be set before the first ``@triton.jit`` kernel module is
imported. ``kernels`` imports its Triton modules lazily, so setting it here,
when pytest loads this conftest (before any test module of this folder is
imported), is enough. On a CUDA machine the variable is left alone and the
Triton path runs on the GPU instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter, config):
    """The compile test's resource table, once, after the results."""
    from kernels_testlib import COMPILE_TABLE

    text = config.stash.get(COMPILE_TABLE, None)
    if text:
        terminalreporter.write_line(text)
