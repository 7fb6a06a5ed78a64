"""`python -m rcgrpo.eval`: score BFCL multi-turn runs.

  --replay FILE.jsonl --out OUT.jsonl   score recorded call strings; each input
      line is {"id": ..., "turns": [[[calls of step 1], [calls of step 2]], ...]}
      (BFCL's result-file structure); each output line is
      {"id", "valid", "r_state", "r_action", "reward"} in input order, or
      {"line", "id", "error"} for a line that could not be scored.
  --ground-truth                         replay every ground truth and print
      per-category and overall accuracy.
  --model PATH                           evaluate a policy (a run's models/<stage>
      folder, any HF folder, or "embedded:smollm2-135m-instruct"): one greedy
      rollout per entry of the test split (or --split train, --subset N per
      category), conditioned on <|high_reward|> by default; prints the table and
      writes eval.json / eval.md into --out (default: runs/eval/<model name>).
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


def evaluate_model(args) -> int:
    """--model: greedy rollouts of the policy on the chosen split, official verdicts."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rcgrpo.evaluate import evaluate, named_entries, select_entries, write_eval
    from rcgrpo.models import load_tokenizer, resolve_model_folder
    from rcgrpo.rollout import make_engine

    folder = resolve_model_folder(args.model)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise SystemExit(f"unknown categories {unknown}; choose from {CATEGORIES}")
    entries = select_entries(args.split, categories, args.subset)
    if args.ids:
        wanted = [i.strip() for i in args.ids.split(",") if i.strip()]
        entries = named_entries(entries, wanted, "--ids", f"in the {args.split} split of {categories}")
    kwargs = {} if args.engine == "hf" else {"max_model_len": args.max_total_tokens}
    engine = make_engine(args.engine, folder, **kwargs)
    result = evaluate(engine, load_tokenizer(folder), entries, args.conditioning, greedy=True,
                      max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
                      doc_style=args.doc_style)
    out = args.out or Path("runs") / "eval" / "".join(c if c.isalnum() or c in "-_." else "_" for c in str(args.model))
    _, md_path = write_eval(result, out, str(args.model))
    print(md_path.read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rcgrpo.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--replay", type=Path, metavar="FILE.jsonl")
    mode.add_argument("--ground-truth", action="store_true")
    mode.add_argument("--model", metavar="PATH")
    parser.add_argument("--out", type=Path, metavar="OUT", help="--replay: output JSONL; --model: output folder")
    parser.add_argument("--split", choices=["test", "train"], default="test")
    parser.add_argument("--subset", type=int, default=None, help="first N entries of each category")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--ids", default="", help="--model: only these comma-separated entry ids of the split")
    parser.add_argument("--conditioning", choices=["high", "low", "none"], default="high")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--doc-style", default="compact", choices=["compact", "compact_no_response", "official"])
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
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
        if args.model:
            return evaluate_model(args)
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
