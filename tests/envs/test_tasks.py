"""Tasks from data (rcgrpo/envs/tasks.py): a datasets.Dataset, a JSONL path, a
.json list or a list of dicts give the same tasks; a bad row is one line
naming the data set, the row and the field."""
import json

import pytest

from rcgrpo.envs.tasks import TaskDataError, load_tasks, sample_tasks
from tests.required import require

ROWS = [
    {"prompt": "Add 2 and 3.", "target": 5, "id": "a"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 1."}],
     "target": 2, "category": "easy",
     "completion": [{"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "add", "arguments": {"amount": 2}}}]},
         {"role": "tool", "name": "add", "content": "2"}, {"role": "assistant", "content": "2"}]},
]


def _summary(tasks):
    return [(t.id, t.category, t.prompt, t.columns(), t.reference) for t in tasks]


def test_every_source_gives_the_same_tasks(tmp_path):
    datasets = require("datasets", "dev")
    expected = _summary(load_tasks(ROWS, None, "train_dataset"))
    assert expected[0][:3] == ("a", "all", [{"role": "user", "content": "Add 2 and 3."}])
    assert expected[1][0] == "train_dataset-1" and expected[1][1] == "easy"
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    as_json = tmp_path / "tasks.json"
    as_json.write_text(json.dumps(ROWS))
    assert _summary(load_tasks(str(jsonl), None, "train_dataset")) == expected
    assert _summary(load_tasks(as_json, None, "train_dataset")) == expected
    # One column type per Dataset: the text prompts as messages, as TRL's conversational data sets keep them.
    uniform = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}] if isinstance(r["prompt"], str)
                else r["prompt"]} for r in ROWS[:1]]
    dataset = datasets.Dataset.from_list(uniform)
    assert _summary(load_tasks(dataset, None, "train_dataset")) == _summary(load_tasks(uniform, None, "x")[:1])


@pytest.mark.parametrize("row,field", [
    ({"target": 1}, "prompt: missing"),
    ({"prompt": 3}, "prompt: expected text or a list of messages, got int"),
    ({"prompt": "  "}, "prompt: empty"),
    ({"prompt": []}, "prompt: an empty list of messages"),
    ({"prompt": [{"content": "hi"}]}, "prompt[0].role: expected one of"),
    ({"prompt": [{"role": "system", "content": "x"}]}, "prompt: no user message"),
    ({"prompt": [{"role": "user", "content": ["a"]}]}, "prompt[0].content: expected text, got list"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {}}}]}]},
     "completion: must end with an assistant message without tool calls"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]},
                                     {"role": "assistant", "content": "x"}]}, "completion[0].tool_calls[0]: expected"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "add", "arguments": "{oops"}}]}, {"role": "assistant", "content": "x"}]},
     "completion[0].tool_calls[0].arguments: not valid JSON"),
    ({"prompt": "hi", "id": [1]}, "id: expected text or an integer, got list"),
    ({"prompt": "hi", "weight": float("nan")}, "weight: nan is not a finite number"),
    ("just text", "expected an object with a \"prompt\", got str"),
])
def test_a_bad_row_is_one_line_naming_row_and_field(row, field):
    with pytest.raises(TaskDataError) as info:
        load_tasks([ROWS[0], row], None, "train_dataset")
    message = str(info.value)
    assert message.startswith("train_dataset row 1 ") and field in message and "\n" not in message


def test_ids_must_be_unique_and_sources_must_exist(tmp_path):
    with pytest.raises(TaskDataError, match="row 1: id 'a' repeats row 0's"):
        load_tasks([ROWS[0], ROWS[0]], None, "train_dataset")
    with pytest.raises(TaskDataError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl", None, "eval_dataset")
    with pytest.raises(TaskDataError, match="is a folder"):
        load_tasks(tmp_path, None, "eval_dataset")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(TaskDataError, match=r"bad.jsonl:2 is not JSON"):
        load_tasks(bad, None, "train_dataset")
    with pytest.raises(TaskDataError, match="no rows"):
        load_tasks([], None, "train_dataset")


def test_a_subset_is_seeded_and_keeps_the_order():
    tasks = load_tasks([{"prompt": f"task {i}"} for i in range(20)], None, "train_dataset")
    chosen = sample_tasks(tasks, 5, seed=3)
    assert chosen == sample_tasks(tasks, 5, seed=3) and len(chosen) == 5
    assert [t.row_number for t in chosen] == sorted(t.row_number for t in chosen)
    assert sample_tasks(tasks, None, seed=3) == tasks


def test_a_datasets_reference_keeps_its_arguments():
    # Arrow stores every call's arguments as one struct: a call gets the other calls' names too, as None.
    datasets = require("datasets", "dev")

    def reference(name, arguments):
        return [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "assistant", "content": "done"}]

    rows = [{"prompt": "a", "completion": reference("calculator", {"expression": "1+1"})},
            {"prompt": "b", "completion": reference("submit_answer", {"answer": "2"})}]
    tasks = load_tasks(datasets.Dataset.from_list(rows), None, "train_dataset")
    assert [t.reference[0]["tool_calls"][0]["function"]["arguments"] for t in tasks] == [
        {"expression": "1+1"}, {"answer": "2"}]
