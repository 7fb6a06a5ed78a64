"""A user's tools under TRL's contract, and one bounded call of a user method.

TRL's `GRPOTrainer` takes `tools` (plain functions with type hints and a
Google-style docstring) and an `environment_factory` whose instances' public
methods are tools (every function of the class not starting with ``_``, other
than ``reset`` and ``get_reward``). The same rules hold here, so an
environment written for TRL runs unchanged. A tool's JSON schema is
transformers' ``get_json_schema`` of it, or the ``json_schema`` attribute a
tool made from another source carries (an MCP server's tools).

Every call into user code (a tool, ``reset``, ``get_reward``, a reward
function) runs through `bounded_call`: on the bounded thread
(rcgrpo.envs.bounded_thread: a time bound and a memory bound, from whichever
thread drives the episode), with whatever it raises caught and named, and
with the module-level state of the user's modules watched
(`ModuleStateGuard`): a call that rebinds, adds or resizes module globals has
them put back where that is possible, and is reported as a failure.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from rcgrpo.envs.bounded_thread import BoundedThread
from rcgrpo.envs.bounded_worker import WorkerOutcome

# Methods of an environment that are not tools (TRL's rule).
NOT_TOOLS = frozenset({"reset", "get_reward"})
# JSON schema types -> the Python values that fit them (bool is no number in JSON).
_JSON_TYPES = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}


def tool_schema(fn: Callable) -> dict:
    """The tool's JSON schema ({"type": "function", "function": {name, description, parameters}})."""
    given = getattr(fn, "json_schema", None)
    if isinstance(given, dict):
        return given
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def environment_methods(instance) -> list[Callable]:
    """The public methods of an environment instance that are its tools (TRL's
    rule: functions of its class, looked up on the class so that properties
    are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")]


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name and schema: what the prompt shows and calls are checked against."""

    name: str
    schema: dict

    @classmethod
    def of(cls, fn: Callable) -> "ToolSpec":
        try:
            schema = tool_schema(fn)
        except Exception as exc:  # transformers' TypeHintParsingException / DocstringParsingException
            raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema can be made of it "
                             f"(type hints and a Google-style docstring with an Args section): {exc}") from None
        name = schema.get("function", {}).get("name") or getattr(fn, "__name__", "")
        return cls(name, schema)

    @property
    def parameters(self) -> dict:
        return self.schema.get("function", {}).get("parameters") or {"type": "object", "properties": {}}


def argument_problem(spec: ToolSpec, fn: Callable, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool (None: they do): an unknown or
    missing parameter, a value of the wrong JSON type, or a signature that
    refuses them."""
    params = spec.parameters
    properties = params.get("properties") or {}
    for name in params.get("required") or []:
        if name not in arguments:
            return f"missing required argument {name!r}"
    if properties and params.get("additionalProperties") is not True:
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; {spec.name} takes {sorted(properties)}"
    for name, value in arguments.items():
        kind = (properties.get(name) or {}).get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind else []
        fits = [t for t in kinds if t in _JSON_TYPES]
        if fits and not any(isinstance(value, _JSON_TYPES[t]) and not (t in ("integer", "number") and
                                                                        isinstance(value, bool)) for t in fits):
            return f"argument {name!r} must be {' or '.join(fits)}, got {type(value).__name__} {value!r:.60}"
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as exc:
        return f"the arguments do not fit {spec.name}'s signature: {exc}"
    except ValueError:  # a callable without a signature (a builtin): nothing more to check
        pass
    return None


def tool_text(value: Any) -> str:
    """A tool's return value as the tool message's text: strings as they are,
    JSON-able values as JSON, anything else its str() (TRL's rule)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        raise TypeError(f"returned {len(value)} bytes, not text")
    if isinstance(value, (dict, list, tuple, int, float, bool)) or value is None:
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(value)


# ---------------------------------------------------------------- module state


def _watched_value(value: Any) -> bool:
    return not isinstance(value, (types.ModuleType, types.FunctionType, type, types.BuiltinFunctionType))


class ModuleStateGuard:
    """The module-level state of user modules, before and after a call.

    Each rollout gets its own environment instance, so state on the instance
    is the rollout's own; module globals are shared by every rollout of the
    process, and a tool that changes them makes rollouts depend on each
    other. The guard records each global's binding and, for a container,
    its size; after the call a rebound, new or deleted name is put back, and
    any change (a container grown or shrunk in place cannot be put back) is
    reported. Only user modules are watched (not rcgrpo's, not the standard
    library's or installed packages' own state)."""

    def __init__(self, modules: Iterable[str]):
        self.names = sorted({m for m in modules if m and m in sys.modules and not m.startswith("rcgrpo.")})

    @classmethod
    def of(cls, *objects: Any) -> "ModuleStateGuard":
        modules = []
        for obj in objects:
            target = obj.__func__ if inspect.ismethod(obj) else obj
            modules.append(getattr(target, "__module__", None) or getattr(type(target), "__module__", None))
        return cls(m for m in modules if m != "builtins")

    def snapshot(self) -> dict[str, dict[str, tuple[Any, int | None]]]:
        out = {}
        for name in self.names:
            space = vars(sys.modules[name])
            out[name] = {k: (v, len(v) if isinstance(v, (list, dict, set)) else None)
                         for k, v in list(space.items()) if not k.startswith("__") and _watched_value(v)}
        return out

    def restore(self, before: dict) -> list[str]:
        """Put rebound names back; the names that changed (module.name)."""
        changed = []
        for name, old in before.items():
            space = vars(sys.modules[name])
            now = {k: v for k, v in list(space.items()) if not k.startswith("__") and _watched_value(v)}
            for key in set(now) | set(old):
                if key not in old:
                    del space[key]
                    changed.append(f"{name}.{key} (added)")
                elif key not in now or now[key] is not old[key][0]:
                    space[key] = old[key][0]
                    changed.append(f"{name}.{key} (rebound)")
                elif old[key][1] is not None and len(now[key]) != old[key][1]:
                    changed.append(f"{name}.{key} (changed in place)")
        return sorted(changed)


# ---------------------------------------------------------------- bounded calls


@dataclass(frozen=True)
class CallResult:
    """What one bounded call of user code did: its value, or why it has none."""

    value: Any = None
    error: str | None = None  # one line: what went wrong
    state_changed: tuple[str, ...] = ()  # module globals it changed (put back where possible)
    abandoned: bool = False  # it did not stop at its bound and still runs on its own thread

    @property
    def ok(self) -> bool:
        return self.error is None


class _Raised:
    def __init__(self, exc: BaseException):
        self.text = f"{type(exc).__name__}: {exc}".strip().rstrip(":")


def _call(fn: Callable, args: Sequence, kwargs: dict) -> Any:
    try:
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):  # an async tool (TRL accepts them): run to completion here
            value = asyncio.run(_awaited(value))
        return value
    except Exception as exc:
        return _Raised(exc)


async def _awaited(awaitable):
    return await awaitable


def bounded_call(fn: Callable, *args, timeout_s: float, guard: ModuleStateGuard | None = None,
                 **kwargs) -> CallResult:
    """`fn(*args, **kwargs)` bounded in time and memory, its failures caught."""
    before = guard.snapshot() if guard is not None else None
    outcome = BoundedThread.shared().run(lambda: _call(fn, args, kwargs), timeout_s)
    changed = tuple(guard.restore(before)) if guard is not None else ()
    if outcome.kind == WorkerOutcome.RETURNED:
        if isinstance(outcome.detail, _Raised):
            return CallResult(error=f"raised {outcome.detail.text}", state_changed=changed)
        return CallResult(outcome.detail, state_changed=changed)
    if outcome.kind == WorkerOutcome.TIMED_OUT:
        return CallResult(error=f"did not return within {timeout_s:g} s", state_changed=changed)
    if outcome.kind == WorkerOutcome.EXHAUSTED:
        return CallResult(error=f"stopped at the memory bound ({outcome.detail or 'out of memory'})",
                          state_changed=changed)
    # WORKER_FAILED: stuck in one native operation (or swallowing the stop), left to finish on its own.
    return CallResult(error=f"was abandoned still running: {outcome.detail}", state_changed=changed, abandoned=True)
