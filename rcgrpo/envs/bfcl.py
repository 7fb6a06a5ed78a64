"""BFCL v4 multi-turn as an environment an agent loop drives step by step.

The turn/step logic follows bfcl_eval's `inference_multi_turn_prompting`:
a turn opens with its user message(s) (a miss_func reveal turn with a message
carrying the newly available function docs); the model is queried; a reply
that decodes to no call, or fails to decode, ends the turn; otherwise the
calls run and their results go back to the model; a turn that reaches more
than 20 executed steps force-terminates the whole entry. What one episode
may make the environment do is bounded (rcgrpo.envs.budget).
"""
from __future__ import annotations

import copy
import time
from typing import Any

from bfcl_eval.constants.default_prompts import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
    MAXIMUM_STEP_LIMIT,
)

from rcgrpo.envs.budget import CALL_DID_NOT_STOP, ENV_TIME_LIMIT, EpisodeBudget
from rcgrpo.envs.calls import Call, DecodeError, Positional, decode_calls
from rcgrpo.envs.data import BFCLEntry, DataError, load_entries
from rcgrpo.envs.executor import DEFAULT_CALL_TIMEOUT_S, CallOutcome, Executor, build_instances
from rcgrpo.envs.results import EpisodeResult, StepResult
from rcgrpo.envs.reward import (
    NOT_EXECUTED_PLACEHOLDER,
    action_reward,
    ground_truth,
    official_verdict,
    state_reward,
)
from rcgrpo.envs.split import split_train_test

__all__ = [
    "BFCLEntry", "DataError", "Episode", "EpisodeBudget", "EpisodeResult", "StepResult",
    "load_entries", "split_train_test", "ground_truth",
]


class Episode:
    """One play-through of one entry, on API instances nobody else sees.

    `positional="drop"` decodes model text as the official decoder does
    (positional arguments silently dropped); `"bind"` binds them to parameter
    names (tolerant; what ground-truth replay uses).
    """

    def __init__(
        self,
        entry: BFCLEntry,
        positional: Positional = "drop",
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        max_steps_per_turn: int = MAXIMUM_STEP_LIMIT,
        budget: EpisodeBudget | None = None,
    ):
        self.entry = entry
        self.positional = positional
        self.max_steps_per_turn = max_steps_per_turn
        self.budget = budget or EpisodeBudget()
        self._executor = Executor(build_instances(entry), timeout_s=call_timeout_s)
        self._methods = self._executor.bound_methods()
        self.turn_index = 0
        self.steps = 0
        self._steps_in_turn = 0
        self.done = False
        self.end_reason: str | None = None
        # What the official checker reads: per turn, the non-empty steps,
        # each a list of canonical call strings.
        self._decoded_turns: list[list[list[str]]] = [[]]
        # Every call that ran (the audit trail), and those of them that
        # succeeded: only these count toward action coverage.
        self._executed: list[Call] = []
        self._succeeded: list[Call] = []
        self._result: EpisodeResult | None = None

    # -- what the model sees -------------------------------------------------
    @property
    def num_turns(self) -> int:
        return len(self.entry.turns)

    def visible_function_docs(self) -> list[dict[str, Any]]:
        """Docs the model has been shown by the current turn: all docs of the
        involved classes except those held out for a later turn."""
        hidden = {
            name
            for turn, names in self.entry.missed_function.items()
            if turn > self.turn_index
            for name in names
        }
        return [copy.deepcopy(d) for d in self.entry.function_docs if d["name"] not in hidden]

    def initial_function_docs(self) -> list[dict[str, Any]]:
        """Docs for the system prompt: everything not held out at all."""
        held = {n for names in self.entry.missed_function.values() for n in names}
        return [copy.deepcopy(d) for d in self.entry.function_docs if d["name"] not in held]

    def revealed_function_docs(self) -> list[dict[str, Any]]:
        """Docs that become available at the current turn (miss_func)."""
        names = self.entry.missed_function.get(self.turn_index, [])
        by_name = {d["name"]: d for d in self.entry.function_docs}
        return [copy.deepcopy(by_name[n]) for n in names if n in by_name]

    def turn_messages(self) -> list[dict[str, str]]:
        """The user message(s) that open the current turn."""
        self._require_active()
        if self.turn_index in self.entry.missed_function:
            # BFCL's prompting mode reveals held-out functions in a user message.
            content = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
                functions=self.revealed_function_docs()
            )
            return [{"role": "user", "content": content}]
        return copy.deepcopy(self.entry.turns[self.turn_index])

    # -- driving -------------------------------------------------------------
    def decode(self, text: str) -> list[Call]:
        """Decode text into calls against this entry's methods (raises DecodeError)."""
        return decode_calls(text, self._methods, self.positional)

    def step(self, assistant_text: str) -> StepResult:
        """Consume one model reply: decode, execute, advance.

        Model output cannot raise out of here: a reply that fails to decode
        for any reason ends the turn as an undecodable one does, and a call
        that fails in any way gets an error result (see `step_calls`).
        """
        self._require_active()
        try:
            calls = self.decode(assistant_text)
        except Exception as exc:  # DecodeError, and whatever else hostile text could provoke
            reason = str(exc) if isinstance(exc, DecodeError) else f"{type(exc).__name__}: {exc}"
            self.steps += 1
            self._end_turn()
            return StepResult([], [], turn_ended=True, done=self.done, decode_error=reason)
        return self.step_calls(calls)

    def step_calls(self, calls: list[Call]) -> StepResult:
        """Execute already-decoded calls as one step (replay uses this)."""
        self._require_active()
        self.steps += 1
        if not calls:
            self._end_turn()
            return StepResult([], [], turn_ended=True, done=self.done)
        messages, record = [], []
        for index, call in enumerate(calls):
            started = time.monotonic()
            try:
                name = call.canonical() if call.rejected is None else call.name
                refused = self.budget.over_calls(index)
                if refused is not None:
                    outcome = CallOutcome(f"Error during execution: {refused}", ran=False)
                else:
                    outcome = self._executor.run(call, timeout_s=self.budget.seconds_left)
            except Exception as exc:  # the executor catches the API's own errors; this is the rest
                outcome = CallOutcome(f"Error during execution: {type(exc).__name__}: {exc}", ran=False)
                name = call.name
            self.budget.spend_seconds(time.monotonic() - started)
            if outcome.ran:
                self._executed.append(call)
                record.append(name)
            else:
                record.append(NOT_EXECUTED_PLACEHOLDER)
            if outcome.succeeded:
                self._succeeded.append(call)
            messages.append({"role": "tool", "name": name, "content": self.budget.clip(outcome.text)})
        self._decoded_turns[-1].append(record)
        self._steps_in_turn += 1
        rejected = [f"{c.name}: {c.rejected}" for c in calls if c.rejected is not None]
        decode_error = "; ".join(rejected) or None
        cut_short = (CALL_DID_NOT_STOP if self._executor.abandoned is not None
                     else ENV_TIME_LIMIT if self.budget.seconds_left <= 0 else None)
        if cut_short is not None:
            self._finish(cut_short)
            return StepResult(calls, messages, turn_ended=True, done=True, decode_error=decode_error)
        if self._steps_in_turn > self.max_steps_per_turn:
            # Official: the turn's record is kept, the entry stops here.
            self._finish("step_limit")
            return StepResult(calls, messages, turn_ended=True, done=True, decode_error=decode_error)
        return StepResult(calls, messages, turn_ended=False, done=False, decode_error=decode_error)

    def end_turn(self) -> None:
        """End the current turn as a reply with no call would."""
        self._require_active()
        self._end_turn()

    def finish(self, reason: str) -> None:
        """Stop early (e.g. the token budget ran out). Idempotent."""
        if not self.done:
            self._finish(reason)

    # -- scoring ---------------------------------------------------------------
    def result(self) -> EpisodeResult:
        """Reward and official verdict of what happened (ends the episode)."""
        if self._result is None:
            self.finish("unfinished")
            valid, error = official_verdict(self.entry, self._decoded_turns)
            r_state = state_reward(self.entry, self._executor.instances)
            r_action = action_reward(self.entry, self._succeeded)
            # A run cut short before its last turn (the official runner's
            # force-terminated case: step limit or token budget), or stopped
            # by its environment budget at any turn, earns nothing, whatever
            # state it happened to leave.
            finished = (len(self._decoded_turns) == len(self.entry.ground_truth)
                        and self.end_reason not in (ENV_TIME_LIMIT, CALL_DID_NOT_STOP))
            self._result = EpisodeResult(
                entry_id=self.entry.id,
                reward=r_state * r_action if finished else 0.0,
                r_state=r_state,
                r_action=r_action,
                valid=valid,
                verdict_error=error,
                turns=min(self.turn_index, self.num_turns),
                steps=self.steps,
                end_reason=self.end_reason or "unfinished",
                executed_calls=[c.canonical() for c in self._executed],
            )
        return self._result

    # -- internals -----------------------------------------------------------
    def _require_active(self) -> None:
        if self.done:
            raise RuntimeError(f"episode {self.entry.id} is over ({self.end_reason})")

    def _end_turn(self) -> None:
        self.turn_index += 1
        self._steps_in_turn = 0
        if self.turn_index >= self.num_turns:
            self._finish("completed")
        else:
            self._decoded_turns.append([])

    def _finish(self, reason: str) -> None:
        self.done = True
        self.end_reason = reason
        # An unfinished turn that recorded nothing is not a turn the model
        # answered; the official runner would not have it either.
        if self.turn_index < self.num_turns and reason != "step_limit" and not self._decoded_turns[-1]:
            self._decoded_turns.pop()
