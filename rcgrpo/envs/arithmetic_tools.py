"""Arithmetic with tools: a small multi-turn tool task for fast CPU studies.

Why this environment exists: the BFCL environment is slow and its tasks are
hard for a 135M model, so studies of the trainer need a second task that is
cheap to run, that a small model can sometimes solve, and whose tasks and
answer scorer the project did not write (so a study cannot quietly grade its
own homework). The tasks come from the `reasoning-gym` package (0.1.25):
three of its procedural arithmetic families (`chain_sum`, `products`,
`basic_arithmetic`), kept small (few terms, one or two digits). The agent
solves them through two tools: `calculator` (exact arithmetic on one
expression) and `submit_answer`; the episode's reward is the package's own
`score_answer` on the submitted answer.

The environment follows TRL's `GRPOTrainer(environment_factory=...)` contract:
the class is built with no arguments, once per rollout; `reset(**row)` gets the
dataset row's columns; its public methods other than `reset` and `get_reward`
are the tools; `get_reward()` scores the finished rollout.

Everything is generated locally from fixed seeds (nothing is downloaded), so
`tasks("train")` and `tasks("test")` are the same lists on every machine.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from fractions import Fraction

NAME = "arithmetic_tools"
SUCCESS_THRESHOLD = 1.0  # the package's scorers give 1.0 for a correct answer, less otherwise

# The split, by construction. reasoning-gym seeds item `idx` of a dataset with
# `Random(seed + idx)`, so two datasets whose seeds differ by less than their
# size share items; the seeds below are therefore far apart (more than any
# size we draw), and the train rows are also filtered against the test rows by
# question text, so the split stays disjoint even if two families collide.
TRAIN_SEED = 1_000_000
TEST_SEED = 9_000_000
FAMILY_SEED_STRIDE = 100_000  # family k draws from seed + k * stride
TRAIN_PER_FAMILY = 1_000  # 3 families: 3,000 training tasks
TEST_PER_FAMILY = 200  # 3 families: 600 held-out tasks
SPLITS = {"train": (TRAIN_SEED, TRAIN_PER_FAMILY), "test": (TEST_SEED, TEST_PER_FAMILY)}

# The families and their reasoning-gym configurations: modest difficulty, so a
# small fine-tuned model has a chance; `basic_arithmetic` brings parentheses,
# negation and division, the other two are plain chains.
FAMILIES: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2},
    "products": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {
        "min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2,
        "format_style": "natural",
    },
}

INSTRUCTION = (
    "Use the calculator tool to compute the result, then call submit_answer with the final number."
)

# Calculator bounds: what a model sends is hostile until proven otherwise.
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE_DIGITS = 30  # numerators and denominators stay below 10**30
DECIMAL_PLACES = 10  # non-integer results are shown rounded to this many places

_MAX_MAGNITUDE = 10**MAX_MAGNITUDE_DIGITS
_BINARY_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: None,  # handled apart: its size must be bounded before it is computed
}
_UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; its message is shown to the model."""


def _checked(value: Fraction) -> Fraction:
    # Bounding every intermediate (not just the result) keeps each step cheap.
    if abs(value.numerator) >= _MAX_MAGNITUDE or value.denominator >= _MAX_MAGNITUDE:
        raise CalculatorError(f"number too large (limit 10**{MAX_MAGNITUDE_DIGITS})")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    exp = exponent.numerator
    if abs(exp) > MAX_EXPONENT:
        raise CalculatorError(f"exponent too large (limit {MAX_EXPONENT})")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero")
    # Estimate the digits before computing, so 99**64 is refused without being built.
    biggest = max(abs(base.numerator), base.denominator)
    if biggest > 1 and abs(exp) * math.log10(biggest) >= MAX_MAGNITUDE_DIGITS:
        raise CalculatorError(f"number too large (limit 10**{MAX_MAGNITUDE_DIGITS})")
    return _checked(base**exp)


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of a whitelisted arithmetic tree; anything else is refused."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        # bool is an int subclass; True + 1 is not arithmetic the task asks for.
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError("only numbers are allowed")
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("only finite numbers are allowed")
        # Through repr so that 0.1 is the decimal 1/10, not the nearest binary float.
        return _checked(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
        return _UNARY_OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _checked(Fraction(_BINARY_OPERATORS[type(node.op)](left, right)))
    raise CalculatorError(
        f"unsupported element {type(node).__name__!r}: use numbers, + - * / // % ** and parentheses"
    )


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic `expression`, parsed with `ast` and
    evaluated over a whitelist of nodes (never `eval`); raises CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip().removesuffix("=").strip()  # tolerate "2 + 3 =", as the questions write it
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long (limit {MAX_EXPRESSION_CHARS} characters)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse the expression ({type(exc).__name__})") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: Fraction) -> str:
    """`value` as the calculator shows it: an integer exactly, otherwise a
    decimal rounded to DECIMAL_PLACES places with trailing zeros removed."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMAL_PLACES)  # Fraction rounds half to even, exactly
    sign = "-" if scaled < 0 else ""
    whole, fraction = divmod(abs(scaled), 10**DECIMAL_PLACES)
    digits = str(fraction).rjust(DECIMAL_PLACES, "0").rstrip("0")
    return f"{sign}{whole}.{digits}" if digits else f"{sign}{whole}"


@functools.cache
def _dataset(family: str, seed: int, size: int):
    # Imported here: reasoning_gym imports all of its ~100 generators (~3 s),
    # which only the processes that build tasks or score answers should pay.
    import reasoning_gym

    return reasoning_gym.create_dataset(family, seed=seed, size=size, **FAMILIES[family])


def _scorer(family: str):
    # The family's own score_answer, bound to the configuration the tasks came
    # from (some scorers read their tolerance from the configuration).
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    return _dataset(family, 0, 1).score_answer


class ArithmeticToolsEnv:
    """One rollout of an arithmetic task, solved with a calculator and scored
    by reasoning-gym's own scorer for the task's family."""

    def __init__(self) -> None:
        self._question: str | None = None
        self._answer: str | None = None
        self._family: str | None = None
        self._submitted: str | None = None

    def reset(self, question: str, answer: str, family: str, **kwargs) -> str | None:
        """Start the episode for one dataset row; other columns are ignored."""
        self._question, self._answer, self._family = question, str(answer), family
        self._submitted = None
        return None  # the prompt already holds the question and the instruction

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: An arithmetic expression using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 5".

        Returns:
            The value of the expression, or an error message.
        """
        try:
            return format_number(evaluate_expression(expression))
        except CalculatorError as exc:
            return f"Error: {exc}"

    def submit_answer(self, answer: str) -> str:
        """Submit the final answer to the task. Only the first submission counts.

        Args:
            answer: The final answer, a number such as "42".

        Returns:
            A confirmation message.
        """
        if self._submitted is not None:
            return f"Error: an answer was already submitted ({self._submitted})."
        # Models often send a JSON number; the scorers expect text.
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            return "Error: the answer must be a non-empty string."
        self._submitted = answer.strip()
        return f"Answer submitted: {self._submitted}"

    def get_reward(self) -> float:
        """The package's score of the submitted answer; 0.0 when none was submitted."""
        if self._submitted is None or self._family is None:
            return 0.0
        entry = {"question": self._question, "answer": self._answer, "metadata": {"source_dataset": self._family}}
        return float(_scorer(self._family)(self._submitted, entry))


def _reference_completion(expression: str, answer: str) -> list[dict]:
    # The trajectory a competent agent takes: one calculator call, then submit.
    result = format_number(evaluate_expression(expression))
    return [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "submit_answer", "arguments": {"answer": answer}}}]},
        {"role": "tool", "name": "submit_answer", "content": f"Answer submitted: {answer}"},
        {"role": "assistant", "content": f"The answer is {answer}."},
    ]


def _family_rows(split: str, family_index: int, family: str, seed: int, count: int, exclude: set[str]) -> list[dict]:
    family_seed = seed + family_index * FAMILY_SEED_STRIDE
    # Draw from a dataset larger than `count`: some items are skipped below.
    dataset = _dataset(family, family_seed, FAMILY_SEED_STRIDE)
    rows, seen = [], set(exclude)
    for idx in range(FAMILY_SEED_STRIDE):
        if len(rows) == count:
            return rows
        item = dataset[idx]
        question, answer = item["question"], item["answer"]
        expression = item["metadata"]["expression"]
        if question in seen:
            continue
        # basic_arithmetic computes "/" as floor division; keep only the items
        # whose exact value is that answer, so an exact calculator agrees with
        # the package and the reference trajectory is right.
        try:
            if evaluate_expression(expression) != int(answer):
                continue
        except CalculatorError:
            continue
        seen.add(question)
        rows.append({
            "id": f"{NAME}/{split}/{family}/{idx}",
            "prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
            "question": question,
            "answer": answer,
            "family": family,
            "completion": _reference_completion(expression, answer),
        })
    raise RuntimeError(f"{family}: only {len(rows)} usable items of {FAMILY_SEED_STRIDE} for {split}")


@functools.cache
def _questions(split: str) -> frozenset[str]:
    return frozenset(row["question"] for row in _build(split))


def _build(split: str) -> list[dict]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    seed, per_family = SPLITS[split]
    # The held-out questions are excluded from training, never the other way
    # round, so the test split does not depend on the train split.
    exclude = set(_questions("test")) if split == "train" else set()
    per_family_rows = [
        _family_rows(split, family_index, family, seed, per_family, exclude)
        for family_index, family in enumerate(FAMILIES)
    ]
    # Interleaved, so that any prefix of the list (a quick study's first N
    # tasks) mixes the families evenly.
    return [row for group in zip(*per_family_rows) for row in group]


def tasks(split: str) -> list[dict]:
    """The rows of `split` ("train": 3,000, "test": 600), in a fixed order.

    Each row: `id` (stable string), `prompt` (one user message: the question
    and the instruction to use the tools), `question`, `answer` and `family`
    (what `ArithmeticToolsEnv.reset` needs) and `completion`, a reference
    trajectory in TRL's conversational format that earns reward 1.0.
    """
    return _build(split)


# What rcgrpo.envs.shipped reads: the environment_factory of this environment.
ENVIRONMENT = ArithmeticToolsEnv
