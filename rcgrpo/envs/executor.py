"""Fresh BFCL API instances per episode, and bounded execution of decoded calls.

Mirrors `bfcl_eval...multi_turn_utils.execute_multi_turn_func_call` in what a
call returns (strings as they are, dicts as JSON, anything else `str()`,
exceptions as "Error during execution: ..."), but dispatches by attribute
lookup on the entry's own methods instead of `eval`, never shares instances
between episodes, and bounds the time and memory a call may take.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    STATELESS_CLASSES,
)

from rcgrpo.envs.bounded_thread import BoundedThread
from rcgrpo.envs.bounded_worker import BoundedWorker, WorkerOutcome
from rcgrpo.envs.calls import Call
from rcgrpo.envs.data import BFCLEntry

# The official executor refuses these names before `eval` (multi_turn_utils).
REFUSED_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})
DEFAULT_CALL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class CallOutcome:
    """What one call did: the tool text the model sees, whether the method
    ran at all, and whether it succeeded: returned without raising and not
    with an error report (BFCL's APIs answer a failure with {"error": ...}).
    Only a call that succeeded counts toward the reward's action coverage: a
    policy must not earn reward for calls that raised (the official checker
    finds their results missing)."""

    text: str
    ran: bool
    succeeded: bool = False


def is_error_report(value: Any) -> bool:
    """BFCL's APIs report a failure by returning {"error": message}."""
    return type(value) is dict and "error" in value


def build_instances(entry: BFCLEntry) -> dict[str, Any]:
    """New API instances for one episode, loaded from `initial_config`.

    The deep copy at the end detaches the instance from module-level data
    that `_load_scenario(long_context=True)` links in (e.g. TravelAPI's
    credit-card and booking extensions): without it one episode's booking
    would change every later episode's starting state.
    """
    instances = {}
    for class_name in entry.involved_classes:
        module = importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name])
        instance = getattr(module, class_name)()
        if class_name not in STATELESS_CLASSES:
            config = copy.deepcopy(entry.initial_config.get(class_name, {}))
            instance._load_scenario(config, long_context=entry.long_context)
        instances[class_name] = copy.deepcopy(instance)
    return instances


def method_table(instances: dict[str, Any]) -> dict[str, tuple[str, Callable[..., Any]]]:
    """Public method name -> (class name, bound method); later classes win,
    as in the official name mapping."""
    table = {}
    for class_name, instance in instances.items():
        for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
            if not name.startswith("_"):
                table[name] = (class_name, method)
    return table


def format_result(value: Any) -> str:
    """The official conversion of a method's return value to tool text."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except Exception:
            return str(value)
    return str(value)


def returned(value: Any) -> CallOutcome:
    """The outcome of a call that returned `value`."""
    return CallOutcome(format_result(value), ran=True, succeeded=not is_error_report(value))


def stateless_call(module: str, class_name: str, method: str, kwargs: dict) -> CallOutcome:
    """One call on a fresh instance of a stateless class: what the bounded
    worker runs. The text is formatted here, at the precision the call itself
    set (`logarithm(precision=33)` prints 33 digits, as the official runner
    shows), before the worker resets it."""
    return returned(getattr(getattr(importlib.import_module(module), class_name)(), method)(**kwargs))


def _over_time(timeout_s: float) -> str:
    return f"Error during execution: call exceeded the {timeout_s:g} s limit"


def _bounded_call_outcome(outcome: WorkerOutcome, timeout_s: float) -> CallOutcome:
    """The outcome of a call that ran bounded (in the stateless worker or on
    the bounded thread), worded as the official executor words a call's."""
    if outcome.kind == WorkerOutcome.RETURNED:
        return outcome.detail  # a CallOutcome made by `returned` where the call ran
    if outcome.kind == WorkerOutcome.RAISED:
        return CallOutcome(f"Error during execution: {outcome.detail}", ran=True)
    if outcome.kind == WorkerOutcome.TIMED_OUT:
        return CallOutcome(_over_time(timeout_s), ran=False)
    if outcome.kind == WorkerOutcome.EXHAUSTED:
        # Stopped by a memory bound, as a timeout stops a call: not run, so
        # the official checker is not asked to run it again.
        return CallOutcome(f"Error during execution: {outcome.detail}", ran=False)
    return CallOutcome(f"Error during execution: worker failed: {outcome.detail}", ran=False)


class Executor:
    """Runs decoded calls against one episode's instances.

    Stateful classes run in-process, on the bounded thread
    (rcgrpo.envs.bounded_thread: their pure-Python loops are stopped at the
    time and memory bounds, from whichever thread drives the episode).
    Stateless classes (MathAPI) run in a separate worker process with a hard
    timeout, because their slow paths are single native operations (big-int
    powers, mpmath at huge precision) that nothing in-process can interrupt;
    being stateless, nothing is lost when the worker is killed.
    """

    def __init__(self, instances: dict[str, Any], timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.instances = instances
        self.methods = method_table(instances)
        self.timeout_s = timeout_s
        # Set when a call was abandoned still running (it did not stop at
        # its bound): the instances may still change, so nothing more runs.
        self.abandoned: str | None = None

    def bound_methods(self) -> dict[str, Callable[..., Any]]:
        return {name: method for name, (_, method) in self.methods.items()}

    def run(self, call: Call, timeout_s: float | None = None) -> CallOutcome:
        """What `call` did. It did not run when it was rejected at decode
        time, refused by name, unknown, or stopped at its time or memory
        bound. `timeout_s` (default: the executor's) bounds this call."""
        timeout_s = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        if self.abandoned is not None:
            return CallOutcome(f"Error during execution: not run: {self.abandoned}", ran=False)
        if call.rejected is not None:
            return CallOutcome(f"Error during execution: {call.rejected}", ran=False)
        if call.name in REFUSED_NAMES:
            return CallOutcome(f"Error during execution: Function call {call.name} is not allowed.", ran=False)
        if call.name not in self.methods:
            return CallOutcome(f"Error during execution: name '{call.name}' is not defined", ran=False)
        class_name, method = self.methods[call.name]
        if class_name in STATELESS_CLASSES:
            outcome = BoundedWorker.shared("stateless_calls").run(
                __name__, "stateless_call",
                dict(module=CLASS_FILE_PATH_MAPPING[class_name], class_name=class_name, method=call.name,
                     kwargs=call.kwargs),
                timeout_s,
            )
            return _bounded_call_outcome(outcome, timeout_s)
        # Fresh argument objects, as the official eval of a string gives:
        # APIs store (and later mutate) the lists they are passed. The text is
        # made on the bounded thread too: formatting a huge result is work.
        kwargs = copy.deepcopy(call.kwargs)
        outcome = BoundedThread.shared().run(lambda: returned(method(**kwargs)), timeout_s)
        if outcome.kind == WorkerOutcome.WORKER_FAILED:
            self.abandoned = f"an earlier call did not stop ({outcome.detail})"
        return _bounded_call_outcome(outcome, timeout_s)
