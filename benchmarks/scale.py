"""How big the benchmark session is: one setting, read by every benchmark.

- ``quick`` (the default): each comparison once at a representative size.
- ``full`` (``--full``): every shape, loss fraction and setting, and the
  studies whose question is already answered (the engine log-prob overhead).
- ``smoke`` (``--smoke``, what CI runs): every path once at tiny sizes; the
  figures must come out finite and saved, no target is held.

``benchmarks/conftest.py`` turns the option into ``RCGRPO_BENCH_SCALE``
before any benchmark module is imported, so the programs a benchmark starts
in a fresh process read the same scale.
"""
from __future__ import annotations

import os

ENV = "RCGRPO_BENCH_SCALE"
SCALES = ("smoke", "quick", "full")


def current() -> str:
    scale = os.environ.get(ENV, "quick")
    if scale not in SCALES:
        raise ValueError(f"{ENV}={scale!r}: expected one of {', '.join(SCALES)}")
    return scale


def pick(smoke, quick, full=None):
    """The value for this session's scale (``full`` defaults to ``quick``'s)."""
    return {"smoke": smoke, "quick": quick, "full": quick if full is None else full}[current()]


def holds_targets() -> bool:
    """Targets (ratios a benchmark asserts) are held at the measured sizes, not at smoke sizes."""
    return current() != "smoke"
