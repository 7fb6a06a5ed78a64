"""Evaluate a policy on BFCL v4 multi-turn: one greedy rollout per entry,
scored by the official checker, tabulated per category like the paper."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from rcgrpo.base.atomic import atomic_write_text
from rcgrpo.conditioning.reward_tokens import token_named
from rcgrpo.envs.bfcl import load_entries, split_train_test
from rcgrpo.envs.data import CATEGORIES
from rcgrpo.evaluation.replay_scoring import accuracy_table
from rcgrpo.rollout.agent_loop import RolloutConfig, run_episodes
from rcgrpo.run.folder import RunFolder


def select_entries(split: str, categories: Sequence[str], subset: int | None) -> list:
    """The split's entries of `categories`; `subset` keeps the first n of
    each category (a stable choice: the split's order)."""
    train, test = split_train_test(load_entries(categories))
    return first_of_each_category({"train": train, "test": test}[split], subset)


def first_of_each_category(pool: Sequence, subset: int | None) -> list:
    """The first `subset` items of each `category` in `pool`, in its order (all when None)."""
    if subset is None:
        return list(pool)
    out, taken = [], defaultdict(int)
    for e in pool:
        if taken[e.category] < subset:
            out.append(e)
            taken[e.category] += 1
    return out


def named_entries(pool: Sequence, ids: Sequence[str], label: str, where: str) -> list:
    """The entries of `pool` (in its order) whose ids are in `ids`; an id not
    in the pool stops with a message naming it (`label`: the setting or flag,
    `where`: what the pool is)."""
    wanted, known = set(ids), {e.id for e in pool}
    missing = [i for i in ids if i not in known]
    if missing:
        raise SystemExit(f"{label}: {missing} are not {where}")
    return [e for e in pool if e.id in wanted]


def evaluate(engine, tokenizer, entries: Sequence, conditioning: str, settings: RolloutConfig) -> dict:
    """One rollout per entry under `conditioning`'s reward token, with the
    rollout `settings` (temperature 0: greedy; the trainer's eval stage gets
    them from rcgrpo.training.rollout_settings.rollout_settings, rcgrpo-eval from a
    saved model's run). {"categories": {cat: accuracy}, "overall": accuracy
    over all entries (the paper's), "macro": mean over categories, "n": {cat:
    entries}, "reward": {cat: mean reward}, "rows": per entry}."""
    rollouts = run_episodes(engine, tokenizer, list(entries), group_size=1, config=settings,
                            reward_tokens=token_named(conditioning))
    by_cat: dict[str, list] = defaultdict(list)
    rows = []
    for entry, r in zip(entries, rollouts):
        by_cat[entry.category].append(r)
        rows.append({"id": entry.id, "valid": r.valid, "reward": r.reward, "r_state": r.r_state,
                     "r_action": r.r_action, "turns": r.turns, "steps": r.steps, "end_reason": r.end_reason})
    # BFCL's categories in the paper's order, then any other environment's, by name.
    cats = [c for c in CATEGORIES if c in by_cat] + sorted(c for c in by_cat if c not in CATEGORIES)
    table = accuracy_table([(e.category, r.valid) for e, r in zip(entries, rollouts)])
    return {
        "categories": {c: table[c] for c in cats},
        "overall": table["overall"],
        "macro": table["macro"],
        "n": {c: len(by_cat[c]) for c in cats},
        "reward": {c: sum(r.reward for r in by_cat[c]) / len(by_cat[c]) for c in cats},
        "conditioning": conditioning,
        "settings": {"conditioning": conditioning, "max_new_tokens": settings.max_new_tokens,
                     "max_total_tokens": settings.max_total_tokens, "doc_style": settings.doc_style,
                     "greedy": settings.temperature == 0.0},
        "rows": rows,
    }


def table_markdown(result: dict, method: str) -> str:
    """The paper's row: accuracy per category and overall (over all entries);
    with several categories also their unweighted mean."""
    cats = list(result["categories"])
    values = [result["categories"][c] for c in cats] + [result["overall"]]
    names = cats + ["overall"]
    if len(cats) > 1:
        values.append(result["macro"])
        names.append("mean of categories")
    head = "| method | " + " | ".join(names) + " |"
    sep = "|---" * (len(names) + 1) + "|"
    cells = " | ".join(f"{100 * v:.2f}" for v in values)
    return "\n".join([head, sep, f"| {method} | {cells} |"])


def write_eval(result: dict, out_dir: Path, method: str, environment: str = "bfcl") -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RunFolder(out_dir).eval_json, RunFolder(out_dir).eval_md
    atomic_write_text(json_path, json.dumps({**result, "method": method, "environment": environment}, indent=1))
    counts = ", ".join(f"{c}: {n}" for c, n in result["n"].items())
    title = (f"BFCL v4 multi-turn ({counts} entries; accuracy %, official checker)" if environment == "bfcl"
             else f"{environment} ({counts} tasks; accuracy %: reward >= the success threshold)")
    atomic_write_text(md_path, f"# {title}\n\n" + table_markdown(result, method) + "\n")
    return json_path, md_path
