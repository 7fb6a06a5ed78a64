"""Which environment a run plays, and its training and evaluation tasks.

BFCL (``env.name bfcl``, the default) keeps its entries, split and official
verdict. Any other environment is a `ToolEnvironment` (TRL's contract,
rcgrpo.envs.tool_env) made from one of three places, in this order: objects
the Python trainer hands in (`UserEnvironment`), a shipped environment
(rcgrpo.envs.shipped), or import strings in the config (``module:attr``,
resolved from the working directory too). Its tasks are the rows of a data
set, each checked before any model loads: a bad row, and a reference
trajectory whose calls fail or do not earn the success threshold, stop the
run with one line naming the row and the field.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rcgrpo.base.errors import UserError
from rcgrpo.conditioning.prompts import ChatTokens, initial_messages
from rcgrpo.config import Config
from rcgrpo.config.schema import BFCL
from rcgrpo.envs.shipped import SHIPPED_ENVIRONMENTS, shipped_module
from rcgrpo.envs.tasks import Task, TaskDataError, load_tasks, sample_tasks
from rcgrpo.envs.tool_env import ToolEnvironment, ToolEpisode
from rcgrpo.evaluation.rollouts import first_of_each_category

# env.name of a run whose environment the Python trainer was given as objects (recorded, not importable).
PYTHON_PREFIX = "python:"


@dataclass
class UserEnvironment:
    """What a TRL user hands the trainer in Python (rcgrpo.trainer)."""

    environment_factory: Callable[[], Any] | None = None
    tools: Sequence[Callable] = ()
    reward_funcs: Sequence[Callable] = ()
    reward_weights: Sequence[float] | None = None
    train_dataset: Any = None
    eval_dataset: Any = None

    @property
    def name(self) -> str:
        """The factory's (else the first tool's) qualified name: what the run records as env.name."""
        named = self.environment_factory or next(iter(self.tools), None)
        return getattr(named, "__qualname__", None) or "tools"


@dataclass
class RunEnvironment:
    """The environment of a run: BFCL (`tool_env` None) or a ToolEnvironment
    with the sources of its training and evaluation rows."""

    tool_env: ToolEnvironment | None = None
    train_source: Any = None
    eval_source: Any = None
    description: str = BFCL
    eval_tasks: list | None = None  # checked and kept by rcgrpo.pipeline.prepare when the run evaluates

    @property
    def is_bfcl(self) -> bool:
        return self.tool_env is None


def import_object(spec: str, what: str) -> Any:
    """`module:attr` (dots in attr walk into it), imported from the installed
    packages or the working directory; one line naming `what` if it fails."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UserError(f"{what}: {spec!r} is not module:attr")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a console script's path lacks the working directory
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:
        raise UserError(f"{what}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{what}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _tool_environment(cfg: Config, factory, tools, reward_funcs, weights, name: str) -> ToolEnvironment:
    e = cfg.env
    return ToolEnvironment(environment_factory=factory, tools=tools, reward_funcs=reward_funcs,
                           reward_weights=weights, success_threshold=e.success_threshold,
                           reward_range=tuple(e.reward_range) if e.reward_range else None,
                           tool_format=e.tool_format, max_tool_steps=e.max_tool_steps,
                           call_timeout_s=e.call_timeout_s, name=name)


def run_environment(cfg: Config, given: UserEnvironment | None = None) -> RunEnvironment:
    """The run's environment (no model loaded; the tool format is chosen at `bind`)."""
    e = cfg.env
    if given is not None:
        name = given.name
        env = _tool_environment(cfg, given.environment_factory, given.tools, given.reward_funcs,
                                given.reward_weights, name)
        return RunEnvironment(env, given.train_dataset if given.train_dataset is not None else e.dataset,
                              given.eval_dataset if given.eval_dataset is not None else e.eval_dataset,
                              PYTHON_PREFIX + name)
    if e.name == BFCL:
        return RunEnvironment()
    if e.name.startswith(PYTHON_PREFIX):
        raise UserError(f"env.name {e.name}: an environment the Python trainer was given as objects; run it with "
                        "RCGRPOTrainer(..., environment_factory=...) again (or name it as module:attr)")
    tools = [import_object(t, "env.tools") for t in e.tools or []]
    rewards = [import_object(r, "env.reward_funcs") for r in e.reward_funcs or []]
    if e.name in SHIPPED_ENVIRONMENTS:
        module = shipped_module(e.name)
        env = _tool_environment(cfg, module.ENVIRONMENT, tools, rewards, None, e.name)
        train = e.dataset if e.dataset is not None else module.tasks("train")
        test = e.eval_dataset if e.eval_dataset is not None else module.tasks("test")
        return RunEnvironment(env, train, test, e.name)
    factory = import_object(e.name, "env.name")
    env = _tool_environment(cfg, factory, tools, rewards, None, e.name)
    return RunEnvironment(env, e.dataset, e.eval_dataset, e.name)


def reference_problem(env: ToolEnvironment, task: Task, episode: ToolEpisode | None = None) -> str | None:
    """Why a task's reference trajectory cannot be an expert: a call it makes
    fails, or it does not earn the success threshold (None: it is fine).
    `episode`: a fresh, unplayed episode of the task to replay it in."""
    replies = env.reference_calls(task)
    if replies is None:
        return None
    episode = episode or env.episode(task)
    for content, calls in replies:
        if episode.done:
            break
        result = episode.step_calls(content, calls)
        failed = [m["content"] for m in result.tool_messages if m["content"].startswith("Error")]
        if failed:
            return f"completion: a call does not run: {failed[0][:200]}"
    outcome = episode.result()
    if episode.failures:
        return f"completion: {episode.failures[0]}"
    if not outcome.valid:
        return (f"completion: its calls earn reward {outcome.reward:g}, below env.success_threshold "
                f"{env.success_threshold:g}")
    return None


def tool_training_tasks(cfg: Config, tokenizer, run_env: RunEnvironment) -> list[Task]:
    """Training tasks of a ToolEnvironment whose opening prompt fits
    `data.max_prompt_tokens`, optionally a seeded subset of `data.train_subset`."""
    if run_env.train_source is None:
        raise UserError(f"environment {run_env.description}: no training tasks: give a train_dataset "
                        "(--env.dataset FILE.jsonl)")
    tasks = sample_tasks(load_tasks(run_env.train_source, run_env.tool_env, "train_dataset"),
                         cfg.data.train_subset, cfg.data.seed)
    fitting = []
    for task in tasks:
        # One fresh episode: its opening prompt is measured, then the reference replayed in it.
        episode = task.new_episode()
        chat = ChatTokens(tokenizer, tools=episode.template_tools)
        if len(chat.prompt_ids(initial_messages(episode, None))) > cfg.data.max_prompt_tokens:
            continue
        problem = reference_problem(run_env.tool_env, task, episode)
        if problem:
            raise TaskDataError(f"train_dataset row {task.row_number} (id {task.id!r}): {problem}")
        fitting.append(task)
    if not fitting:
        raise UserError(f"train_dataset: no task has a prompt under data.max_prompt_tokens="
                        f"{cfg.data.max_prompt_tokens}")
    return fitting


def tool_evaluation_tasks(run_env: RunEnvironment, subset: int | None) -> list[Task]:
    """Evaluation tasks: the first `subset` of each category (all when None)."""
    if run_env.eval_source is None:
        raise UserError(f"environment {run_env.description}: no evaluation tasks: give an eval_dataset "
                        "(--env.eval_dataset FILE.jsonl), or leave eval out of --stages")
    return first_of_each_category(load_tasks(run_env.eval_source, run_env.tool_env, "eval_dataset"), subset)
