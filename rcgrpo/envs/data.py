"""BFCL v4 multi-turn entries, ground truth and function docs, read from the
files that ship inside the installed `bfcl_eval` package."""
from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from rcgrpo.base.errors import UserError

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
FILE_PREFIX = "BFCL_v4_multi_turn_"

# bfcl_eval's class -> doc file mapping (constants/executable_backend_config.py);
# repeated here because importing that module is cheap but this keeps data
# loading free of bfcl's import-time side effects.
DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}


class DataError(UserError, RuntimeError):
    """A BFCL data file is missing, unreadable or malformed."""


@dataclass(frozen=True, eq=False)  # identity hash: caches key on the entry object
class BFCLEntry:
    """One multi-turn entry with its ground truth.

    `turns[t]` is the list of user messages that open turn t (empty for a
    miss_func reveal turn); `ground_truth[t]` the call strings expected in it.
    `function_docs` holds the docs of every involved class, held-out ones
    included; `missed_function` maps a turn index to the names revealed then.
    """

    id: str
    category: str
    index: int
    turns: list[list[dict[str, str]]]
    initial_config: dict[str, Any]
    involved_classes: list[str]
    ground_truth: list[list[str]]
    function_docs: list[dict[str, Any]]
    missed_function: dict[int, list[str]] = field(default_factory=dict)

    @property
    def long_context(self) -> bool:
        return "long_context" in self.category

    def as_bfcl_test_entry(self) -> dict[str, Any]:
        """The dict shape bfcl_eval's checker reads (a fresh deep copy)."""
        return {
            "id": self.id,
            "question": copy.deepcopy(self.turns),
            "initial_config": copy.deepcopy(self.initial_config),
            "involved_classes": list(self.involved_classes),
        }


def data_dir() -> Path:
    """The `data/` folder of the installed bfcl_eval, found without importing it."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "bfcl_eval is not installed: run `make install` "
            "(it installs bfcl-eval==2026.3.23 with --no-deps)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines; every failure names the file (and line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"BFCL data file is missing: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"BFCL data file is unreadable: {path}: {exc}") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"BFCL data file is malformed: {path}:{lineno}: {exc}") from None
        if not isinstance(row, dict):
            raise DataError(f"BFCL data file is malformed: {path}:{lineno}: not a JSON object")
        rows.append(row)
    return rows


@lru_cache(maxsize=None)
def _function_docs(root: str, class_name: str) -> tuple[str, ...]:
    path = Path(root) / "multi_turn_func_doc" / DOC_FILES[class_name]
    # Cached as JSON text so that no caller can mutate the shared copy.
    return tuple(json.dumps(d) for d in read_jsonl(path))


def function_docs(class_name: str, root: Path | None = None) -> list[dict[str, Any]]:
    if class_name not in DOC_FILES:
        raise DataError(f"unknown BFCL class {class_name!r}")
    return [json.loads(d) for d in _function_docs(str(root or data_dir()), class_name)]


def load_category(category: str, root: Path | None = None) -> list[BFCLEntry]:
    """All entries of one category, with ground truth, in file order."""
    if category not in CATEGORIES:
        raise DataError(f"unknown multi-turn category {category!r}; expected one of {CATEGORIES}")
    root = Path(root or data_dir())
    qpath = root / f"{FILE_PREFIX}{category}.json"
    apath = root / "possible_answer" / f"{FILE_PREFIX}{category}.json"
    answers = {}
    for row in read_jsonl(apath):
        if "id" not in row or not isinstance(row.get("ground_truth"), list):
            raise DataError(f"BFCL data file is malformed: {apath}: entry without id/ground_truth")
        answers[row["id"]] = row["ground_truth"]
    entries = []
    for row in read_jsonl(qpath):
        try:
            entry_id = row["id"]
            turns = row["question"]
            classes = row["involved_classes"]
            config = row.get("initial_config", {})
        except KeyError as exc:
            raise DataError(f"BFCL data file is malformed: {qpath}: entry missing {exc}") from None
        if entry_id not in answers:
            raise DataError(f"no ground truth for {entry_id} in {apath}")
        if len(answers[entry_id]) != len(turns):
            raise DataError(f"{entry_id}: {len(turns)} turns but {len(answers[entry_id])} ground-truth turns "
                            f"in {apath}")
        docs = [d for c in classes for d in function_docs(c, root)]
        missed = {int(t): list(names) for t, names in row.get("missed_function", {}).items()}
        entries.append(
            BFCLEntry(
                id=entry_id,
                category=category,
                index=int(entry_id.rsplit("_", 1)[1]),
                turns=turns,
                initial_config=config,
                involved_classes=list(classes),
                ground_truth=answers[entry_id],
                function_docs=docs,
                missed_function=missed,
            )
        )
    return entries


def load_entries(categories=CATEGORIES, root: Path | None = None) -> list[BFCLEntry]:
    """Entries of the given categories (all four: 800), category by category."""
    return [e for c in categories for e in load_category(c, root)]
