"""The arithmetic-with-tools environment (rcgrpo.envs.arithmetic_tools): its
split, its tools' schemas, its reference trajectories replayed against the
package's own scorer, the calculator's refusal of hostile input, and the
prompt length bound under the project's small model's tokenizer."""
from __future__ import annotations

import builtins
import inspect
import json
import os
import time

import pytest
from transformers.utils import get_json_schema

from rcgrpo.envs import arithmetic_tools as at
from rcgrpo.envs.arithmetic_tools import ArithmeticToolsEnv

TOOL_NAMES = ("calculator", "submit_answer")
MAX_PROMPT_TOKENS = 600

# The rendering measured for the length bound: the tools' schemas in a system
# prompt, as the project's fallback for a chat template without tool support
# (the embedded SmolLM2's) writes them; its wording is mirrored here, not
# imported, so that this bound does not move with that module's text.
FALLBACK_SYSTEM_PROMPT = (
    "You can call tools to solve the user's task. To call a tool, reply with one or more blocks of the form\n"
    '<tool_call>{{"name": "tool_name", "arguments": {{"param": value}}}}</tool_call>\n'
    "and nothing else; each call's result comes back to you in a tool message. When the task is done, reply "
    "without a tool call.\n\nTools (JSON schemas):\n{tools}"
)


@pytest.fixture(scope="module")
def train():
    return at.tasks("train")


@pytest.fixture(scope="module")
def test_rows():
    return at.tasks("test")


def _schemas() -> list[dict]:
    return [get_json_schema(getattr(ArithmeticToolsEnv, name)) for name in TOOL_NAMES]


def _replay(row: dict) -> tuple[ArithmeticToolsEnv, list[str]]:
    """Run the row's reference calls in a fresh environment; the tool outputs."""
    env = ArithmeticToolsEnv()
    env.reset(**row)
    outputs = []
    for message in row["completion"]:
        for call in message.get("tool_calls", []):
            function = call["function"]
            outputs.append(getattr(env, function["name"])(**function["arguments"]))
    return env, outputs


# --- the tools ------------------------------------------------------------------

def test_tools_are_the_public_methods_and_have_schemas():
    public = {name for name, _ in inspect.getmembers(ArithmeticToolsEnv, inspect.isfunction)
              if not name.startswith("_")} - {"reset", "get_reward"}
    assert public == set(TOOL_NAMES)
    for schema, name in zip(_schemas(), TOOL_NAMES):
        assert schema["function"]["name"] == name
        parameters = schema["function"]["parameters"]
        assert all(p.get("description") for p in parameters["properties"].values())
        assert parameters["required"] == list(parameters["properties"])
    assert ArithmeticToolsEnv().reset(question="q", answer="1", family="chain_sum", extra="ignored") is None


@pytest.mark.parametrize("expression, shown", [
    ("(3 + 4) * 5", "35"),
    ("-( 7 - 9 ) * -3", "-6"),
    ("7 / 2", "3.5"),
    ("1 / 3", "0.3333333333"),
    ("-2 / 3", "-0.6666666667"),
    ("0.1 + 0.2", "0.3"),
    ("7 // 2 + 7 % 2", "4"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("12 - 5 =", "7"),  # the chain_sum questions end with "="
])
def test_calculator_is_exact(expression, shown):
    assert ArithmeticToolsEnv().calculator(expression) == shown


HOSTILE = [
    "9**9**9",  # the classic: would take forever and all memory
    "10**1000",
    "2**64**2",
    "(10**20)**(10**20)",
    "99**64",
    "10**29 * 10**29",
    "1e308 * 1e308",
    "1e400",
    "2 ** 0.5",
    "0 ** -1",
    "1 / 0",
    "5 % 0",
    "__import__('os').system('touch /tmp/arithmetic_tools_pwned')",
    "open('/tmp/arithmetic_tools_pwned', 'w')",
    "os",
    "x + 1",
    "abs(-1)",
    "(1).__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "'a' * 10",
    "[1, 2]",
    "True + 1",
    "1 if 1 else 2",
    "lambda: 1",
    "(x := 3)",
    "1 < 2",
    "1j * 1j",
    "1; 2",
    "",
    "9" * 300,
    "(" * 150 + "1" + ")" * 150,
    "-" * 300 + "1",
]


def test_calculator_refuses_hostile_input_without_evaluating(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the calculator must never eval/exec model input")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    env = ArithmeticToolsEnv()
    start = time.monotonic()
    for expression in HOSTILE:
        result = env.calculator(expression)
        assert result.startswith("Error: "), (expression, result)
    assert time.monotonic() - start < 2.0  # refused up front, never computed
    assert not os.path.exists("/tmp/arithmetic_tools_pwned")
    for not_a_string in (None, 3, ["1+1"], {"a": 1}):
        assert env.calculator(not_a_string).startswith("Error: ")


def test_nothing_submitted_earns_zero():
    env = ArithmeticToolsEnv()
    env.reset(question="Solve 2 * 3.", answer="6", family="products")
    env.calculator("2 * 3")
    assert env.get_reward() == 0.0
    assert env.submit_answer("   ").startswith("Error: ")
    assert env.get_reward() == 0.0


# --- the tasks ------------------------------------------------------------------

@pytest.mark.slow
def test_split_sizes_and_disjointness(train, test_rows):
    assert len(train) == 3 * at.TRAIN_PER_FAMILY >= 2000
    assert len(test_rows) == 3 * at.TEST_PER_FAMILY >= 500
    for rows in (train, test_rows):
        assert len({r["id"] for r in rows}) == len(rows)
        assert len({r["question"] for r in rows}) == len(rows)
        assert {r["family"] for r in rows} == set(at.FAMILIES)
    assert not {r["id"] for r in train} & {r["id"] for r in test_rows}
    assert not {r["question"] for r in train} & {r["question"] for r in test_rows}


@pytest.mark.slow
def test_tasks_are_deterministic_and_serialisable(train, test_rows):
    assert at.tasks("train") == train and at.tasks("test") == test_rows
    # A fresh process would get the same: the rows depend on the seeds only.
    at._dataset.cache_clear()
    at._questions.cache_clear()
    assert json.dumps(at.tasks("test")) == json.dumps(test_rows)
    row = train[0]
    assert set(row) == {"id", "prompt", "question", "answer", "family", "completion"}
    assert row["prompt"] == [{"role": "user", "content": f"{row['question']}\n{at.INSTRUCTION}"}]
    with pytest.raises(ValueError):
        at.tasks("validation")


@pytest.mark.slow
def test_reference_trajectories_earn_full_reward(train, test_rows):
    # Every held-out row and an evenly spread sample of 200 training rows.
    sample = test_rows + train[:: len(train) // 200]
    for row in sample:
        env, outputs = _replay(row)
        expected = [m["content"] for m in row["completion"] if m["role"] == "tool"]
        assert outputs == expected, row["id"]
        assert env.get_reward() == at.SUCCESS_THRESHOLD == 1.0, row["id"]
    roles = [m["role"] for m in train[0]["completion"]]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]


@pytest.mark.slow
def test_wrong_answers_earn_less(test_rows):
    for row in test_rows[:30]:
        wrong = str(int(row["answer"]) + 1)
        for submitted in (wrong, "", "no idea"):
            env = ArithmeticToolsEnv()
            env.reset(**row)
            env.submit_answer(submitted)
            assert env.get_reward() < at.SUCCESS_THRESHOLD, (row["id"], submitted)
    # Only the first submission counts: a right answer after a wrong one does not rescue it.
    row = test_rows[0]
    env = ArithmeticToolsEnv()
    env.reset(**row)
    env.submit_answer(str(int(row["answer"]) - 1))
    assert env.submit_answer(row["answer"]).startswith("Error: ")
    assert env.get_reward() < at.SUCCESS_THRESHOLD
    # A JSON number is accepted as the answer's text.
    env = ArithmeticToolsEnv()
    env.reset(**row)
    env.submit_answer(int(row["answer"]))
    assert env.get_reward() == 1.0


@pytest.mark.slow
def test_prompts_fit_the_small_models_budget(train, test_rows):
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder

    tok = load_tokenizer(resolve_model_folder("embedded:smollm2-135m-instruct"))
    schemas = _schemas()
    tools = "\n".join(json.dumps(s, separators=(",", ":"), ensure_ascii=False) for s in schemas)
    system = {"role": "system", "content": FALLBACK_SYSTEM_PROMPT.format(tools=tools)}
    longest, longest_id = 0, None
    for row in train + test_rows:
        text = tok.apply_chat_template([system, *row["prompt"]], tools=schemas, tokenize=False,
                                       add_generation_prompt=True)
        count = len(tok(text, add_special_tokens=False)["input_ids"])
        if count > longest:
            longest, longest_id = count, row["id"]
    print(f"longest rendered first prompt: {longest} tokens ({longest_id})")
    assert longest <= MAX_PROMPT_TOKENS, (longest, longest_id)
