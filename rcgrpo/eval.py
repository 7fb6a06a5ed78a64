"""`python -m rcgrpo.eval`: score BFCL multi-turn runs.

  --replay FILE.jsonl --out OUT.jsonl   score recorded call strings; each input
      line is {"id": ..., "turns": [[[calls of step 1], [calls of step 2]], ...]}
      (BFCL's result-file structure); each output line is
      {"id", "valid", "r_state", "r_action", "reward"} in input order, or
      {"line", "id", "error"} for a line that could not be scored.
  --ground-truth                         replay every ground truth and print
      per-category and overall accuracy.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from rcgrpo.envs.bfcl import CATEGORIES, DataError, load_entries
from rcgrpo.envs.replay import replay, replay_ground_truth


def score_replay_file(src: Path, dst: Path, positional: str = "drop") -> tuple[int, int]:
    """Score every line of `src` into `dst`; returns (scored, errors)."""
    entries = {e.id: e for e in load_entries()}
    try:
        lines = src.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"cannot read replay file {src}: {exc}")
    scored = errors = 0
    with dst.open("w", encoding="utf-8") as out:
        for lineno, line in enumerate(tqdm(lines, desc="scoring", unit="entry"), 1):
            if not line.strip():
                continue
            record = _score_line(line, lineno, entries, positional)
            errors += "error" in record
            scored += "error" not in record
            out.write(json.dumps(record) + "\n")
    return scored, errors


def _score_line(line: str, lineno: int, entries, positional: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return {"line": lineno, "id": None, "error": f"malformed JSON: {exc}"}
    if not isinstance(row, dict):
        return {"line": lineno, "id": None, "error": "line is not a JSON object"}
    entry_id = row.get("id")
    if entry_id not in entries:
        return {"line": lineno, "id": entry_id, "error": f"unknown id {entry_id!r}"}
    if "turns" not in row:
        return {"line": lineno, "id": entry_id, "error": "missing 'turns'"}
    try:
        result = replay(entries[entry_id], row["turns"], positional=positional)
    except ValueError as exc:
        return {"line": lineno, "id": entry_id, "error": f"malformed turns: {exc}"}
    return {
        "id": entry_id,
        "valid": result.valid,
        "r_state": result.r_state,
        "r_action": result.r_action,
        "reward": result.reward,
    }


def accuracy_table(rows: list[tuple[str, bool]]) -> dict[str, float]:
    """Per-category accuracy and the unweighted mean over categories."""
    by_cat: dict[str, list[bool]] = defaultdict(list)
    for category, valid in rows:
        by_cat[category].append(valid)
    table = {c: sum(v) / len(v) for c, v in by_cat.items()}
    table["overall"] = sum(table.values()) / len(table) if table else 0.0
    return table


def print_table(table: dict[str, float], counts: dict[str, int]) -> None:
    print(f"{'category':<14} {'entries':>7} {'accuracy':>9}")
    for name in [*CATEGORIES, "overall"]:
        if name in table:
            print(f"{name:<14} {counts.get(name, sum(counts.values())):>7} {100 * table[name]:>8.2f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rcgrpo.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--replay", type=Path, metavar="FILE.jsonl")
    mode.add_argument("--ground-truth", action="store_true")
    parser.add_argument("--out", type=Path, metavar="OUT.jsonl")
    parser.add_argument("--positional", choices=["drop", "bind"], default="drop",
                        help="drop positional arguments as the official decoder does (default), or bind them")
    args = parser.parse_args(argv)
    try:
        if args.replay:
            if args.out is None:
                parser.error("--replay needs --out")
            scored, errors = score_replay_file(args.replay, args.out, args.positional)
            print(f"scored {scored} entries, {errors} error lines -> {args.out}")
            return 0
        entries = load_entries()
        rows, counts = [], defaultdict(int)
        for entry in tqdm(entries, desc="ground truth", unit="entry"):
            rows.append((entry.category, replay_ground_truth(entry).valid))
            counts[entry.category] += 1
        print_table(accuracy_table(rows), counts)
        return 0
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
