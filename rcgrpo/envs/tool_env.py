"""An environment in TRL's contract, played as rcgrpo episodes.

`ToolEnvironment` holds what a user hands TRL's `GRPOTrainer`: an
`environment_factory` (one instance per rollout: ``reset(**row)``, its public
methods as tools, an optional ``get_reward()``), standalone `tools`, and
`reward_funcs` (``f(prompts, completions, **columns) -> list[float | None]``).
`ToolEpisode` plays one task with it: the row's prompt (``reset``'s text
appended to the last user message, as TRL does), the tools rendered by the
chat template or the documented fallback (rcgrpo.envs.tool_calls), each reply
parsed for calls, each call checked against the tool's schema and signature
and run bounded (rcgrpo.envs.tools), its result fed back as a tool message; a
reply without a call ends the episode. The reward is the weighted sum of
``get_reward()`` and the reward functions (None: that source abstains, as in
TRL); the rollout succeeds iff the reward reaches `success_threshold`.

User code is untrusted in the same ways model output is: a tool, ``reset``,
``get_reward`` or a reward function that raises, hangs, floods, returns
something unusable or changes module-level state is a scored failure of that
rollout (reward: the bottom of `reward_range`, else 0) with one warning line
naming the environment and the method; the run goes on.
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from rcgrpo.base.errors import UserError
from rcgrpo.envs.budget import CALL_DID_NOT_STOP, ENV_TIME_LIMIT, EpisodeBudget
from rcgrpo.envs.results import EpisodeResult, StepResult
from rcgrpo.envs.tasks import Task
from rcgrpo.envs.tool_calls import ToolCall, ToolCallFormat, read_call, tool_call_format
from rcgrpo.envs.tools import (
    CallResult,
    ModuleStateGuard,
    ToolSpec,
    argument_problem,
    bounded_call,
    environment_methods,
    tool_text,
)

log = logging.getLogger("rcgrpo.envs")

DEFAULT_MAX_TOOL_STEPS = 16
DEFAULT_CALL_TIMEOUT_S = 10.0
# End reasons of a rollout its environment failed (scored as a failure).
RESET_FAILED, REWARD_FAILED, STATE_CHANGED = "reset_failed", "reward_failed", "module_state_changed"


class EnvironmentContractError(UserError, ValueError):
    """An environment that cannot be used at all (its factory raises, it has no
    `reset`, no reward source, a tool without a schema)."""


def _name_of(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


class _Warnings:
    """One line per distinct problem: a broken reward function would otherwise
    print once per rollout."""

    def __init__(self):
        self.seen: dict[str, int] = {}

    def warn(self, text: str) -> None:
        count = self.seen.get(text, 0)
        self.seen[text] = count + 1
        if count == 0:
            log.warning(text)


@dataclass
class ToolEnvironment:
    """The user's environment, tools and rewards; `bind(tokenizer)` before playing."""

    environment_factory: Callable[[], Any] | None = None
    tools: Sequence[Callable] = ()
    reward_funcs: Sequence[Callable] = ()
    reward_weights: Sequence[float] | None = None
    success_threshold: float = 1.0
    reward_range: tuple[float, float] | None = None
    tool_format: str = "auto"
    max_tool_steps: int = DEFAULT_MAX_TOOL_STEPS
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    name: str = ""
    budget: Callable[[], EpisodeBudget] = EpisodeBudget
    format: ToolCallFormat | None = field(default=None, repr=False)
    warnings: _Warnings = field(default_factory=_Warnings, repr=False)

    def __post_init__(self):
        self.tools, self.reward_funcs = list(self.tools), list(self.reward_funcs)
        if not self.name:
            self.name = _name_of(self.environment_factory) if self.environment_factory else "tools"
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise EnvironmentContractError(f"{len(self.reward_weights)} reward weights for {len(self.reward_funcs)} "
                                           "reward functions")
        self.has_env_reward = False
        self.specs = self._probe()

    def _probe(self) -> dict[str, ToolSpec]:
        """Build one instance (TRL probes one too) to find the tools and check
        the contract, before any model loads."""
        functions: list[Callable] = list(self.tools)
        if self.environment_factory is not None:
            try:
                instance = self.environment_factory()
            except Exception as exc:
                raise EnvironmentContractError(f"environment {self.name}: environment_factory() raised "
                                               f"{type(exc).__name__}: {exc}") from None
            if not callable(getattr(instance, "reset", None)):
                raise EnvironmentContractError(f"environment {self.name}: its instances need a callable reset(**row) "
                                               "(TRL's environment contract)")
            self.has_env_reward = callable(getattr(type(instance), "get_reward", None))
            functions += environment_methods(instance)
        if not self.reward_funcs and not self.has_env_reward:
            raise EnvironmentContractError(f"environment {self.name}: no reward source: pass reward_funcs, or an "
                                           "environment whose instances define get_reward()")
        specs = {}
        for fn in functions:
            try:
                spec = ToolSpec.of(fn)
            except ValueError as exc:
                raise EnvironmentContractError(f"environment {self.name}: {exc}") from None
            if spec.name in specs:
                raise EnvironmentContractError(f"environment {self.name}: two tools are named {spec.name!r}")
            specs[spec.name] = spec
        if self.reward_range is not None:
            low, high = self.reward_range
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise EnvironmentContractError(f"environment {self.name}: reward_range {self.reward_range} is not "
                                               "[low, high] with low < high")
        return specs

    @property
    def schemas(self) -> list[dict]:
        return [s.schema for s in self.specs.values()]

    def bind(self, tokenizer) -> "ToolEnvironment":
        """Choose the tool-call format for `tokenizer`'s chat template."""
        try:
            self.format = tool_call_format(self.tool_format, tokenizer)
        except ValueError as exc:
            raise EnvironmentContractError(str(exc)) from None
        return self

    def episode(self, task: Task) -> "ToolEpisode":
        if self.format is None:
            raise RuntimeError(f"environment {self.name}: bind(tokenizer) before playing episodes")
        return ToolEpisode(self, task)

    @property
    def failure_reward(self) -> float:
        return self.reward_range[0] if self.reward_range is not None else 0.0

    # -- references ------------------------------------------------------------
    def reference_calls(self, task: Task) -> list[tuple[str, list[ToolCall]]] | None:
        """The reference trajectory's assistant replies as (content, calls), or None."""
        reference = task.reference
        if not reference:
            return None
        replies = []
        for message in reference:
            if message.get("role") != "assistant":
                continue
            calls = [read_call(call) for call in message.get("tool_calls") or []]
            replies.append((message.get("content") or "", calls))
        return replies

    def expert_replies(self, task: Task) -> list[str] | None:
        """The reference as the reply texts the model would write (this format)."""
        replies = self.reference_calls(task)
        return None if replies is None else [self.format.reply_text(c, calls) for c, calls in replies]

    def near_miss_replies(self, task: Task, seed: int) -> Iterator[list[str]]:
        """The reference with one mistake (one call dropped, or one argument
        changed), in a seeded order: candidates for a near-miss failure."""
        replies = self.reference_calls(task) or []
        spots = [(r, c) for r, (_, calls) in enumerate(replies) for c in range(len(calls))]
        variants = [("dropped", r, c) for r, c in spots]
        variants += [("changed", r, c) for r, c in spots if replies[r][1][c].arguments]
        random.Random(f"{seed}:{task.id}").shuffle(variants)
        for kind, r, c in variants:
            changed = [(content, list(calls)) for content, calls in replies]
            call = changed[r][1][c]
            if kind == "dropped":
                del changed[r][1][c]
            else:
                key = sorted(call.arguments)[0]
                changed[r][1][c] = ToolCall(call.name, {**call.arguments, key: different_value(call.arguments[key])})
            yield [self.format.reply_text(content, calls) for content, calls in changed]


def different_value(value):
    """A value of the same kind that differs from `value` (a near miss's wrong argument)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_x"
    return type(value)()  # an empty list / dict / tuple


def _noop(*args, **kwargs) -> None:
    return None


class ToolEpisode:
    """One rollout of one task: a fresh environment instance, reset with the row."""

    def __init__(self, spec: ToolEnvironment, task: Task):
        self.spec, self.task = spec, task
        self.budget = spec.budget()
        self.steps = 0
        self.tool_steps = 0
        self.tool_errors = 0
        self.done = False
        self.end_reason: str | None = None
        self.failures: list[str] = []  # why the environment failed this rollout (scored as a failure)
        self.completion: list[dict] = []  # TRL's conversational completion: assistant and tool messages
        self.completion_ids: list[int] = []  # what TRL's reward functions get as completion_ids
        self._prompt_len: int | None = None
        self._result: EpisodeResult | None = None
        self.instance = None
        self.prompt = task.prompt
        self._tools: dict[str, Callable] = {getattr(t, "__name__", ""): t for t in spec.tools}
        if spec.environment_factory is not None:
            self._start_instance()
        self.guard = ModuleStateGuard.of(*self._tools.values(), *(
            [type(self.instance)] if self.instance is not None else []))

    # -- the prompt --------------------------------------------------------------
    def _start_instance(self) -> None:
        made = bounded_call(self.spec.environment_factory, timeout_s=self.spec.call_timeout_s)
        if not made.ok:
            self._fail(RESET_FAILED, f"environment_factory() {made.error}")
            return
        self.instance = made.value
        self._tools.update({m.__name__: m for m in environment_methods(self.instance)})
        reset = bounded_call(self.instance.reset, timeout_s=self.spec.call_timeout_s, **self.task.columns())
        if not reset.ok:
            self._fail(RESET_FAILED, f"reset() {reset.error}")
            return
        observation = reset.value
        if observation is None:
            return
        if not isinstance(observation, str):
            self._fail(RESET_FAILED, f"reset() returned {type(observation).__name__}, not text or None")
            return
        last = self.prompt[-1]
        self.prompt = self.prompt[:-1] + [{**last, "content": last["content"] + observation}]

    def opening_messages(self) -> list[dict]:
        """The prompt's messages, after the fallback format's system prompt (if any)."""
        system = self.spec.format.system_prompt(self.spec.schemas)
        messages = [dict(m) for m in self.prompt]
        if system is None:
            return messages
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": system + "\n\n" + messages[0]["content"]}
            return messages
        return [{"role": "system", "content": system}] + messages

    @property
    def template_tools(self) -> list[dict] | None:
        return self.spec.format.template_tools(self.spec.schemas)

    def turn_messages(self) -> list[dict]:
        raise RuntimeError("an episode under the TRL contract has one user turn: it ends with the turn")

    # -- driving -----------------------------------------------------------------
    def step_reply(self, reply_ids: Sequence[int], text: str, conversation_ids: Sequence[int]) -> StepResult:
        """Consume one sampled reply: parse its calls, run them bounded, feed the results back."""
        self._require_active()
        prefix = list(conversation_ids[:len(conversation_ids) - len(reply_ids)])
        if self._prompt_len is None:  # the first reply starts where the prompt ends
            self._prompt_len = len(prefix)
        self.completion_ids = list(conversation_ids[self._prompt_len:])
        parsed = self.spec.format.parse(text, reply_ids, prefix, self.spec.schemas)
        return self.step_calls(parsed.content, parsed.calls)

    def step_calls(self, content: str, calls: list[ToolCall]) -> StepResult:
        """Consume one reply already read as `content` and `calls` (a reference's, when it is checked)."""
        self._require_active()
        self.steps += 1
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
        self.completion.append(message)
        if not calls:
            self._finish("completed")
            return StepResult([], [], turn_ended=True, done=True)
        self.tool_steps += 1
        if self.tool_steps > self.spec.max_tool_steps:
            self._finish("step_limit")
            return StepResult(calls, [], turn_ended=True, done=True)
        messages = []
        for index, call in enumerate(calls):
            if self.done:  # a call failed the rollout (module state): the rest of the reply does not run
                break
            messages.append(self._run(index, call))
        self.completion.extend(messages)
        errors = "; ".join(c.error for c in calls if c.error) or None
        if not self.done and self.budget.seconds_left <= 0:
            self._finish(ENV_TIME_LIMIT)
        # A call that changed module state ended the episode (`_fail`).
        return StepResult(calls, messages, turn_ended=self.done, done=self.done, decode_error=errors)

    def _run(self, index: int, call: ToolCall) -> dict:
        """One call's tool message; the call runs only if everything about it checks out."""
        started = time.monotonic()
        text = self._outcome(index, call)
        self.budget.spend_seconds(time.monotonic() - started)
        return {"role": "tool", "name": call.name, "content": self.budget.clip(text)}

    def _outcome(self, index: int, call: ToolCall) -> str:
        refused = self.budget.over_calls(index)
        fn = self._tools.get(call.name)
        problem = (refused or call.error
                   or (f"unknown tool {call.name!r}; the tools are {sorted(self._tools)}" if fn is None else None)
                   or argument_problem(self.spec.specs[call.name], fn, call.arguments))
        if problem:
            self.tool_errors += 1
            return f"Error: {problem}"
        result = bounded_call(fn, timeout_s=min(self.spec.call_timeout_s, max(self.budget.seconds_left, 0.01)),
                              guard=self.guard, **call.arguments)
        if result.state_changed:
            self._fail(STATE_CHANGED, f"tool {call.name} changed module-level state: "
                       f"{', '.join(result.state_changed)} (put back where it could be)")
        if result.abandoned:  # it may still change the instance: nothing more of this episode runs
            self._fail(CALL_DID_NOT_STOP, f"tool {call.name} {result.error}")
        if not result.ok:
            self.tool_errors += 1
            return f"Error: {call.name} {result.error}"
        try:
            return tool_text(result.value)
        except Exception as exc:
            self.tool_errors += 1
            return f"Error: {call.name} {type(exc).__name__}: {exc}"

    def finish(self, reason: str) -> None:
        if not self.done:
            self._finish(reason)

    # -- scoring -----------------------------------------------------------------
    def result(self) -> EpisodeResult:
        if self._result is None:
            self.finish("unfinished")
            reward = self._reward() if not self.failures else self.spec.failure_reward
            success = not self.failures and reward >= self.spec.success_threshold
            self._result = EpisodeResult(
                entry_id=self.task.id, reward=reward, r_state=reward, r_action=reward, valid=success,
                verdict_error="; ".join(self.failures) or None, turns=1 if self.steps else 0, steps=self.steps,
                end_reason=self.end_reason or "unfinished",
                executed_calls=[c["function"]["name"] for m in self.completion for c in m.get("tool_calls", [])],
            )
        return self._result

    def _reward(self) -> float:
        """get_reward() and the reward functions, each checked; any broken one fails the rollout."""
        values: list[float] = []
        if self.spec.has_env_reward and self.instance is not None:
            got = bounded_call(self.instance.get_reward, timeout_s=self.spec.call_timeout_s, guard=self.guard)
            value = self._checked(got, "get_reward()", single=True)
            if value is not None:
                values.append(value)
        weights = self.spec.reward_weights or [1.0] * len(self.spec.reward_funcs)
        columns = {k: [v] for k, v in self.task.columns().items()}
        for fn, weight in zip(self.spec.reward_funcs, weights):
            got = bounded_call(fn, timeout_s=self.spec.call_timeout_s, guard=self.guard,
                               prompts=[self.prompt], completions=[self.completion],
                               completion_ids=[self.completion_ids], environments=[self.instance],
                               trainer_state=None, log_extra=_noop, log_metric=_noop, **columns)
            value = self._checked(got, f"reward function {_name_of(fn)}", single=False)
            if value is not None:
                values.append(weight * value)
        if self.failures:
            return self.spec.failure_reward
        if not values:
            self._fail(REWARD_FAILED, "every reward source returned None for this rollout")
            return self.spec.failure_reward
        return float(sum(values))

    def _checked(self, got: CallResult, what: str, single: bool) -> float | None:
        """The value a reward source gave this rollout, or None (it abstained or failed)."""
        if got.state_changed:
            self._fail(STATE_CHANGED, f"{what} changed module-level state: {', '.join(got.state_changed)}")
        if not got.ok:
            self._fail(REWARD_FAILED, f"{what} {got.error}")
            return None
        value = got.value
        if not single:
            if not isinstance(value, (list, tuple)) or len(value) != 1:
                self._fail(REWARD_FAILED, f"{what} returned {type(value).__name__} "
                           f"{'of length ' + str(len(value)) if isinstance(value, (list, tuple)) else ''}"
                           ", not a list with one reward per completion")
                return None
            value = value[0]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)  # a numpy or torch scalar
            except (TypeError, ValueError):
                self._fail(REWARD_FAILED, f"{what} returned {type(value).__name__}, not a number")
                return None
        value = float(value)
        if not math.isfinite(value):
            self._fail(REWARD_FAILED, f"{what} returned {value}")
            return None
        low_high = self.spec.reward_range
        if low_high is not None and not low_high[0] <= value <= low_high[1]:
            self._fail(REWARD_FAILED, f"{what} returned {value:g}, outside reward_range {list(low_high)}")
            return None
        return value

    # -- internals ---------------------------------------------------------------
    def _fail(self, reason: str, text: str) -> None:
        self.failures.append(text)
        self.spec.warnings.warn(f"environment {self.spec.name}: {text}; the rollout is scored as a failure")
        if not self.done:
            self._finish(reason)

    def _require_active(self) -> None:
        if self.done:
            raise RuntimeError(f"episode {self.task.id} is over ({self.end_reason})")

    def _finish(self, reason: str) -> None:
        self.done = True
        self.end_reason = reason
