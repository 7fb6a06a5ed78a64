"""The environments rcgrpo ships besides BFCL, by the name `env.name` takes.

Each is a module with an environment class in TRL's contract (`ENVIRONMENT`),
`tasks(split)` giving its rows ("train" / "test") and `SUCCESS_THRESHOLD`.
Imported only when chosen (their task packages are heavy to import)."""
from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Callable

from rcgrpo.base.errors import UserError


def _arithmetic() -> ModuleType:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise UserError("env.name arithmetic needs the reasoning-gym package: pip install 'rcgrpo[arithmetic]'")
    from rcgrpo.envs import arithmetic_tools

    return arithmetic_tools


SHIPPED_ENVIRONMENTS: dict[str, Callable[[], ModuleType]] = {
    # reasoning-gym's arithmetic tasks solved with a calculator and submit_answer (rcgrpo/envs/arithmetic_tools.py)
    "arithmetic": _arithmetic,
}


def shipped_module(name: str) -> ModuleType:
    return SHIPPED_ENVIRONMENTS[name]()
