"""Tasks from data: the rows of a `train_dataset` / `eval_dataset`.

A data set is a Hugging Face `datasets.Dataset`, a JSONL file (one JSON object
a line; a .json file holding a list also works) or a list of dicts, in TRL's
shape: a ``prompt`` column (text, or a list of chat messages) plus any
columns, which reach the environment's ``reset(**row)`` and the reward
functions by name. Optional columns with a meaning here:

* ``completion``: a reference trajectory in TRL's conversational format
  (assistant messages with ``tool_calls``, tool messages), which RCTP may use
  as the expert; its tool messages are not trusted: the environment runs the
  calls again.
* ``id``: the task's identity (default ``<label>-<row number>``); rollouts
  of one task form one group, whatever their reward tags.
* ``category``: a label the evaluation table is split by (default "all").

Every row is checked before any model loads; a bad row stops with one line
naming the data set, the row and the field.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rcgrpo.base import json_input
from rcgrpo.base.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_CATEGORY = "all"


class TaskDataError(UserError, ValueError):
    """A data set is missing, unreadable, or has a row that cannot be a task."""


@dataclass
class Task:
    """One row as a task of `environment` (an rcgrpo.envs.tool_env.ToolEnvironment)."""

    id: str
    row: dict
    environment: Any
    category: str = DEFAULT_CATEGORY
    row_number: int = -1  # its row in the data set, for messages

    def new_episode(self):
        return self.environment.episode(self)

    @property
    def prompt(self) -> list[dict]:
        return prompt_messages(self.row["prompt"])

    @property
    def reference(self) -> list[dict] | None:
        return self.row.get("completion")

    def columns(self) -> dict:
        """What `reset` and the reward functions get besides the prompt (TRL: every other column)."""
        return {k: v for k, v in self.row.items() if k not in ("prompt", "completion")}


def prompt_messages(prompt: str | list) -> list[dict]:
    """A prompt as chat messages (text becomes one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def read_rows(source: Any, label: str) -> list[dict]:
    """The rows of `source`: a datasets.Dataset, a .jsonl / .json path, or a list of dicts."""
    if source is None:
        raise TaskDataError(f"{label}: no data set given")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            raise TaskDataError(f"{label}: {path} is a folder; give a .jsonl file")
        if not path.is_file():
            raise TaskDataError(f"{label}: {path} does not exist")
        try:
            text = json_input.read_text(path)
        except ValueError as exc:
            raise TaskDataError(f"{label}: {exc}") from None
        if path.suffix == ".json":
            try:
                rows = json_input.loads(text)
            except ValueError as exc:
                raise TaskDataError(f"{label}: {path} is not JSON: {exc}") from None
            if not isinstance(rows, list):
                raise TaskDataError(f"{label}: {path} must hold a list of rows, got {type(rows).__name__}")
            return rows
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json_input.loads(line))
                except ValueError as exc:
                    raise TaskDataError(f"{label}: {path}:{number} is not JSON: {exc}") from None
        return rows
    to_list = getattr(source, "to_list", None)
    if callable(to_list):  # datasets.Dataset
        return [_without_arrow_fill(row) for row in to_list()]
    if isinstance(source, (list, tuple)):
        return list(source)
    raise TaskDataError(f"{label}: expected a datasets.Dataset, a .jsonl path or a list of dicts, "
                        f"got {type(source).__name__}")


def _without_arrow_fill(row: dict) -> dict:
    """A Dataset row's reference as written: Arrow gives every tool call the
    union of all calls' argument names, the absent ones None; those are
    dropped (an argument written as null is indistinguishable there)."""
    completion = row.get("completion")
    if not isinstance(completion, list):
        return row
    for message in completion:
        for call in (message or {}).get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
                fn["arguments"] = {k: v for k, v in fn["arguments"].items() if v is not None}
    return row


def _message_problem(message: Any, where: str, reference: bool) -> str | None:
    if not isinstance(message, dict):
        return f"{where}: expected a message object, got {type(message).__name__}"
    role = message.get("role")
    if role not in ROLES:
        return f"{where}.role: expected one of {ROLES}, got {role!r}"
    content = message.get("content", "" if reference else None)
    if content is not None and not isinstance(content, str):
        return f"{where}.content: expected text, got {type(content).__name__}"
    if content is None and not (reference and role == "assistant"):
        return f"{where}.content: missing"
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if role != "assistant" or not reference:
        return f"{where}.tool_calls: only a reference's assistant messages carry tool calls"
    if not isinstance(calls, list):
        return f"{where}.tool_calls: expected a list, got {type(calls).__name__}"
    for i, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return f"{where}.tool_calls[{i}]: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}"
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return f"{where}.tool_calls[{i}].arguments: not valid JSON"
        if not isinstance(args, dict):
            return f"{where}.tool_calls[{i}].arguments: expected an object, got {type(args).__name__}"
    return None


def row_problem(row: Any) -> str | None:
    """The first field of `row` that cannot be a task's, as "field: what is wrong"."""
    if not isinstance(row, dict):
        return f"expected an object with a \"prompt\", got {type(row).__name__}"
    if "prompt" not in row:
        return "prompt: missing (every row needs a prompt: text or a list of messages)"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            return "prompt: empty"
    elif isinstance(prompt, list):
        if not prompt:
            return "prompt: an empty list of messages"
        for i, m in enumerate(prompt):
            problem = _message_problem(m, f"prompt[{i}]", reference=False)
            if problem:
                return problem
        if not any(m["role"] == "user" for m in prompt):
            return "prompt: no user message"
    else:
        return f"prompt: expected text or a list of messages, got {type(prompt).__name__}"
    if "completion" in row and row["completion"] is not None:
        completion = row["completion"]
        if not isinstance(completion, list) or not completion:
            return "completion: expected a non-empty list of messages (TRL's conversational format)"
        for i, m in enumerate(completion):
            problem = _message_problem(m, f"completion[{i}]", reference=True)
            if problem:
                return problem
        if completion[-1].get("role") != "assistant" or completion[-1].get("tool_calls"):
            return "completion: must end with an assistant message without tool calls (the reply that ends it)"
    if "id" in row and not isinstance(row["id"], (str, int)):
        return f"id: expected text or an integer, got {type(row['id']).__name__}"
    if "category" in row and not isinstance(row["category"], str):
        return f"category: expected text, got {type(row['category']).__name__}"
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}: {value} is not a finite number"
    return None


def load_tasks(source: Any, environment, label: str) -> list[Task]:
    """`source`'s rows as tasks of `environment`, every row checked;
    TaskDataError names `label` (e.g. "train_dataset"), the row and the field."""
    rows = read_rows(source, label)
    if not rows:
        raise TaskDataError(f"{label}: the data set has no rows")
    tasks, seen = [], {}
    for number, row in enumerate(rows):
        problem = row_problem(row)
        task_id = str(row["id"]) if isinstance(row, dict) and "id" in row else f"{label}-{number}"
        if problem:
            raise TaskDataError(f"{label} row {number} (id {task_id!r}): {problem}")
        if task_id in seen:
            raise TaskDataError(f"{label} row {number}: id {task_id!r} repeats row {seen[task_id]}'s "
                                "(a task's id must be unique: its rollouts form one group)")
        seen[task_id] = number
        tasks.append(Task(task_id, dict(row), environment, row.get("category", DEFAULT_CATEGORY), number))
    return tasks


def sample_tasks(tasks: Sequence[Task], n: int | None, seed: int) -> list[Task]:
    """A seeded choice of `n` tasks in their original order (all when n is None or too large)."""
    if n is None or n >= len(tasks):
        return list(tasks)
    keep = sorted(random.Random(seed).sample(range(len(tasks)), n))
    return [tasks[i] for i in keep]
