"""Score BFCL multi-turn calls without a policy: a file of recorded call
strings (`--replay`), or every entry's ground truth (`--ground-truth`),
each replayed through the environment and judged by the official checker."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rcgrpo.base import json_input
from rcgrpo.base.atomic import atomic_output
from rcgrpo.envs.data import CATEGORIES, load_entries
from rcgrpo.envs.replay import replay, replay_ground_truth
from rcgrpo.run.metrics import progress


def score_replay_file(src: Path, dst: Path, positional: str = "drop") -> tuple[int, int]:
    """Score every line of `src` into `dst`; returns (scored, errors)."""
    entries = {e.id: e for e in load_entries()}
    try:
        lines = src.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"cannot read replay file {src}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SystemExit(f"replay file {src} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    scored = errors = 0
    # Atomic: a crash leaves the previous --out file (or none), never part of one.
    with atomic_output(dst) as out:
        for lineno, line in enumerate(progress(lines, desc="scoring", unit="entry"), 1):
            if not line.strip():
                continue
            record = _score_line(line, lineno, entries, positional)
            errors += "error" in record
            scored += "error" not in record
            out.write(json.dumps(record) + "\n")
    return scored, errors


def _score_line(line: str, lineno: int, entries, positional: str) -> dict:
    try:
        row = json_input.loads(line)
    except ValueError as exc:
        return {"line": lineno, "id": None, "error": f"malformed JSON: {exc}"}
    if not isinstance(row, dict):
        return {"line": lineno, "id": None, "error": "line is not a JSON object"}
    entry_id = row.get("id")
    if not isinstance(entry_id, str):
        return {"line": lineno, "id": None, "error": f"'id' must be a string, got {type(entry_id).__name__}"}
    if entry_id not in entries:
        return {"line": lineno, "id": entry_id, "error": f"unknown id {entry_id!r}"}
    if "turns" not in row:
        return {"line": lineno, "id": entry_id, "error": "missing 'turns'"}
    try:
        result = replay(entries[entry_id], row["turns"], positional=positional)
    except ValueError as exc:
        return {"line": lineno, "id": entry_id, "error": f"malformed turns: {exc}"}
    except Exception as exc:  # the file is untrusted input: one bad line never ends the scoring
        return {"line": lineno, "id": entry_id, "error": f"could not be scored: {type(exc).__name__}: {exc}"}
    return {
        "id": entry_id,
        "valid": result.valid,
        "r_state": result.r_state,
        "r_action": result.r_action,
        "reward": result.reward,
    }


def accuracy_table(rows: list[tuple[str, bool]]) -> dict[str, float]:
    """Per-category accuracy, "overall": the accuracy over all entries (the
    paper's overall, a multiple of 1/80 on its test split), and "macro": the
    unweighted mean over categories (bfcl_eval's own summary)."""
    by_cat: dict[str, list[bool]] = defaultdict(list)
    for category, valid in rows:
        by_cat[category].append(valid)
    table = {c: sum(v) / len(v) for c, v in by_cat.items()}
    macro = sum(table.values()) / len(table) if table else 0.0
    table["overall"] = sum(valid for _, valid in rows) / len(rows) if rows else 0.0
    table["macro"] = macro
    return table


def print_table(table: dict[str, float], counts: dict[str, int]) -> None:
    print(f"{'category':<14} {'entries':>7} {'accuracy':>9}")
    total = sum(counts.values())
    for name in [*CATEGORIES, "overall", "macro"]:
        if name in table:
            print(f"{name:<14} {counts.get(name, total):>7} {100 * table[name]:>8.2f}%")


def ground_truth_table() -> tuple[dict[str, float], dict[str, int]]:
    """(accuracy_table, entries per category) of every entry's ground truth replayed."""
    rows, counts = [], defaultdict(int)
    for entry in progress(load_entries(), desc="ground truth", unit="entry"):
        rows.append((entry.category, replay_ground_truth(entry).valid))
        counts[entry.category] += 1
    return accuracy_table(rows), counts
