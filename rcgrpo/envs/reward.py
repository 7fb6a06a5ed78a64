"""The paper's reward (R_state * R_action) and the official BFCL verdict."""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

from rcgrpo.envs.bounded_worker import BoundedWorker, WorkerOutcome
from rcgrpo.envs.calls import Call, decode_calls
from rcgrpo.envs.data import BFCLEntry
from rcgrpo.envs.executor import Executor, build_instances

# Stands in, in the checker's input, for a call this project did not run
# (rejected as unsafe, refused, timed out). Evaluating it only raises
# NameError, so the checker sees a step that produced an error and changed
# nothing, which is what such a call did here.
NOT_EXECUTED_PLACEHOLDER = "_rcgrpo_call_not_executed()"

# A pristine copy of long_context's module-level data, taken at import time
# before any checker run: the official executor links instances to these
# objects, so a long_context check can mutate them for every later check.
_LONG_CONTEXT_PRISTINE = {
    name: copy.deepcopy(value)
    for name, value in vars(long_context).items()
    if name.isupper() and isinstance(value, (dict, list))
}


def restore_long_context_state() -> None:
    """Put long_context's module data back, in place (other modules hold
    references to these same objects)."""
    for name, pristine in _LONG_CONTEXT_PRISTINE.items():
        current = getattr(long_context, name)
        if current != pristine:
            if isinstance(current, dict):
                current.clear()
                current.update(copy.deepcopy(pristine))
            else:
                current[:] = copy.deepcopy(pristine)


@dataclass(frozen=True)
class GroundTruth:
    """Ground-truth calls with positional arguments bound to names, and the
    public state of every instance after running all of them."""

    calls: tuple[tuple[Call, ...], ...]
    final_state: dict[str, dict[str, Any]]

    @property
    def flat_calls(self) -> list[Call]:
        return [c for turn in self.calls for c in turn]

    def canonical_turns(self) -> list[list[str]]:
        return [[c.canonical() for c in turn] for turn in self.calls]


def public_state(instance: Any) -> dict[str, Any]:
    """The attributes the official state check compares."""
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


@lru_cache(maxsize=1024)
def ground_truth(entry: BFCLEntry) -> GroundTruth:
    """Ground truth of an entry, executed once per entry object."""
    executor = Executor(build_instances(entry))
    methods = executor.bound_methods()
    turns = []
    for turn in entry.ground_truth:
        calls = []
        for text in turn:
            (call,) = decode_calls(text, methods, positional="bind")
            if call.rejected:
                raise ValueError(f"{entry.id}: ground-truth call {text!r} does not decode: {call.rejected}")
            executor.run(call)
            calls.append(call)
        turns.append(tuple(calls))
    state = {name: copy.deepcopy(public_state(inst)) for name, inst in executor.instances.items()}
    return GroundTruth(tuple(turns), state)


def state_reward(entry: BFCLEntry, instances: dict[str, Any]) -> float:
    """R_state: 1 iff every instance's public attributes equal those after
    the ground truth (the official state check, applied at the end)."""
    expected = ground_truth(entry).final_state
    for class_name, gt_attrs in expected.items():
        model_attrs = vars(instances[class_name])
        for attr, value in gt_attrs.items():
            if model_attrs.get(attr) != value:
                return 0.0
    return 1.0


def action_reward(entry: BFCLEntry, executed: Sequence[Call]) -> float:
    """R_action: 1 iff every ground-truth call is matched by an executed call
    with the same name and every ground-truth argument present and equal
    (extra arguments allowed). Order-free over the whole trajectory; each
    executed call matches at most one ground-truth call (a bipartite
    matching, so two identical ground-truth calls need two executed ones)."""
    gt_calls = ground_truth(entry).flat_calls
    candidates = [
        [j for j, ex in enumerate(executed) if _covers(ex, gt)] for gt in gt_calls
    ]
    match_of: dict[int, int] = {}  # executed index -> ground-truth index

    def assign(i: int, seen: set[int]) -> bool:
        for j in candidates[i]:
            if j in seen:
                continue
            seen.add(j)
            if j not in match_of or assign(match_of[j], seen):
                match_of[j] = i
                return True
        return False

    return float(all(assign(i, set()) for i in range(len(gt_calls))))


def _covers(executed: Call, gt: Call) -> bool:
    if executed.name != gt.name:
        return False
    return all(k in executed.kwargs and executed.kwargs[k] == v for k, v in gt.kwargs.items())


# The official checker runs the ground truth and the model's calls again
# (ms for a real entry); past this bound the verdict is "invalid".
CHECK_TIMEOUT_S = 60.0


def official_verdict(entry: BFCLEntry, decoded_turns: list[list[list[str]]]) -> tuple[bool, str | None]:
    """(valid, error) from bfcl_eval's own `multi_turn_checker`.

    `decoded_turns[t]` lists turn t's non-empty steps, each a list of
    canonical call strings. A record with fewer turns than the ground truth
    is the runner's force-terminated case. The checker executes the calls
    again (MathAPI's included), so it runs in a bounded worker process
    (rcgrpo.envs.bounded_worker): its time and memory are bounded and no
    state it sets reaches this process.
    """
    if len(decoded_turns) != len(entry.ground_truth):
        return False, (
            f"multi_turn:force_terminated: {len(decoded_turns)} model turns "
            f"for {len(entry.ground_truth)} ground-truth turns"
        )
    outcome = BoundedWorker.shared("official_checker").run(
        __name__, "checker_verdict",
        dict(decoded_turns=decoded_turns, ground_truth=entry.ground_truth, test_entry=entry.as_bfcl_test_entry(),
             category=entry.category, long_context=entry.long_context),
        CHECK_TIMEOUT_S,
    )
    if outcome.kind == WorkerOutcome.RETURNED:
        return outcome.detail
    if outcome.kind == WorkerOutcome.TIMED_OUT:
        return False, f"checker exceeded the {CHECK_TIMEOUT_S:g} s bound"
    return False, f"checker failed ({outcome.kind}): {outcome.detail}"


def checker_verdict(decoded_turns, ground_truth, test_entry, category, long_context) -> tuple[bool, str | None]:
    """The official checker on one record, in this process (the worker's
    side of `official_verdict`). Each evaluation uses a unique instance key
    and deletes the instances the checker cached under it."""
    key = f"rcgrpo_{uuid.uuid4().hex}"
    try:
        result = multi_turn_checker(decoded_turns, ground_truth, test_entry, category, key)
    except Exception as exc:  # the checker asserts on inconsistent input
        return False, f"checker raised {type(exc).__name__}: {exc}"
    finally:
        cache = vars(multi_turn_utils)
        for name in [n for n in cache if n.startswith(key)]:
            del cache[name]
        if long_context:
            restore_long_context_state()
    if result.get("valid"):
        return True, None
    return False, f"{result.get('error_type')}: {result.get('error_message')}"
