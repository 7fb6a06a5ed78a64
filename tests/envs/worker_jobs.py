"""Functions the bounded-worker tests ask the worker to run (it imports
them by module name: the tests run from the repository root)."""
import decimal
import time

import mpmath


def allocate(n_bytes: int) -> int:
    return len(bytearray(n_bytes))


def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def set_precision(dps: int, prec: int) -> tuple[int, int]:
    mpmath.mp.dps = dps
    decimal.getcontext().prec = prec
    return mpmath.mp.dps, decimal.getcontext().prec


def precision() -> tuple[int, int]:
    return mpmath.mp.dps, decimal.getcontext().prec
