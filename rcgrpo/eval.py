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
      category); prints the table and writes eval.json / eval.md into --out
      (default: runs/eval/<model name>).

Settings of --model (flags given explicitly always win):
  a run's runs/<name>/models/<stage> folder: that run's config.toml supplies
      --max-new-tokens (eval.max_new_tokens), --max-total-tokens
      (grpo.max_total_tokens) and --doc-style (data.doc_style); --conditioning
      is the run's eval.conditioning when the stage's policy was trained with
      reward tokens (rctp, rc-grpo, and grpo after rctp), else none (sft, and
      grpo after sft).
  any other model: 512 / 8192 / compact, and --conditioning high for a local
      folder whose tokenizer already has <|high_reward|>, none for the embedded
      model, a hub id or a folder without the tokens (they never saw them).
  One line says where the settings came from; eval.json records them under
  "settings". A run config that cannot be read is an error (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from rcgrpo.atomic import atomic_output
from rcgrpo.envs.data import CATEGORIES, load_entries
from rcgrpo.envs.replay import replay, replay_ground_truth
from rcgrpo.errors import DEBUG_ENV, DEBUG_FLAG, UserError, run_command
from rcgrpo.reward_tokens import CONDITIONING_NAMES, stage_saw_reward_tokens


def score_replay_file(src: Path, dst: Path, positional: str = "drop") -> tuple[int, int]:
    """Score every line of `src` into `dst`; returns (scored, errors)."""
    entries = {e.id: e for e in load_entries()}
    try:
        lines = src.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"cannot read replay file {src}: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        raise SystemExit(f"replay file {src} is not UTF-8 text (byte {exc.start}: {exc.reason})")
    scored = errors = 0
    # Atomic: a crash leaves the previous --out file (or none), never part of one.
    with atomic_output(dst) as out:
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


DEFAULTS = {"max_new_tokens": 512, "max_total_tokens": 8192, "doc_style": "compact"}
SETTINGS = ("max_new_tokens", "max_total_tokens", "doc_style", "conditioning")


class EvalSettingsError(UserError, ValueError):
    """The settings of --model cannot be worked out (e.g. a broken run config)."""


@dataclass
class EvalSettings:
    """The generation and prompt settings one --model evaluation runs under."""

    max_new_tokens: int
    max_total_tokens: int
    doc_style: str
    conditioning: str
    source: str  # "runs/x/config.toml" or "built-in defaults"
    stage: str | None = None  # the run's stage, for a models/<stage> folder
    why_conditioning: str = ""  # why this conditioning, when not from a flag
    from_flags: list[str] = field(default_factory=list)  # settings the user gave

    def describe(self) -> str:
        """One line: the values and where they came from."""
        parts = []
        for name in SETTINGS:
            text = f"{name} {getattr(self, name)}"
            if name in self.from_flags:
                text += " (flag)"
            elif name == "conditioning" and self.why_conditioning:
                text += f" ({self.why_conditioning})"
            parts.append(text)
        return f"settings from {self.source}: " + ", ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


def run_stage_of(model: str) -> tuple[Path, str] | None:
    """(the run's config.toml, the stage) when `model` is a run's
    models/<stage> folder, else None."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    path = path.resolve()
    config = path.parent.parent / "config.toml"
    if path.parent.name != "models" or not config.is_file():
        return None
    return config, path.name


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else Path(rel).as_posix()


def _load_run_config(config_path: Path):
    """The run's Config; a broken file is one EvalSettingsError line naming it."""
    from rcgrpo.config import ConfigError, load_config

    shown = _shown(config_path)
    try:
        return load_config(shown, check_files=False)
    except ConfigError as exc:
        message = "; ".join(" ".join(p.split()) for p in exc.problems)
    except (OSError, UnicodeDecodeError) as exc:
        message = f"cannot be read: {exc}"
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # e.g. a value where a [section] belongs
        message = f"cannot be used: {type(exc).__name__}: {exc}"
    if shown not in message:
        message = f"run config {shown}: {message}"
    raise EvalSettingsError(f"{message} (fix the file, or copy the model folder out of the run)")


def _has_own_reward_tokens(model: str) -> tuple[bool, str]:
    """Whether `model` outside a run already knows the reward tokens, and why."""
    from rcgrpo.models import EMBEDDED, _has_reward_tokens

    if str(model) == EMBEDDED:
        return False, "the embedded model has no reward tokens"
    local = Path(model).expanduser()
    if not local.exists():
        return False, f"{model} has no reward tokens"  # a hub id; a bad path fails when it loads
    try:
        has = _has_reward_tokens(local)
    except Exception:  # not a loadable tokenizer: the model load names the problem
        has = False
    return has, f"{model} {'has' if has else 'has no'} reward tokens"


def resolve_eval_settings(model: str, args) -> EvalSettings:
    """The settings to evaluate `model` under: explicit flags (non-None
    attributes of `args`), then its run's config.toml when `model` is a run's
    models/<stage> folder, then the built-in defaults. Loads no engine and no
    weights (at most a tokenizer). Raises EvalSettingsError for a broken run
    config or a stage folder whose training the stage name does not tell."""
    given = {name: getattr(args, name, None) for name in SETTINGS}
    from_flags = [name for name in SETTINGS if given[name] is not None]
    run = run_stage_of(model)
    if run is not None:
        config_path, stage = run
        cfg = _load_run_config(config_path)
        base = {"max_new_tokens": cfg.eval.max_new_tokens, "max_total_tokens": cfg.grpo.max_total_tokens,
                "doc_style": cfg.data.doc_style}
        source, why = _shown(config_path), f"stage {stage}"
        if given["conditioning"] is None:
            try:
                saw = stage_saw_reward_tokens(stage, cfg.finetune_stage)
            except ValueError as exc:
                raise EvalSettingsError(f"{model}: {exc}, so whether it was trained with reward tokens "
                                        "is unknown; pass --conditioning") from exc
            base["conditioning"] = cfg.eval.conditioning if saw else "none"
            if not saw:
                why = f"stage {stage} of {cfg.run.pipeline} never saw reward tokens"
        run_stage = stage
    else:
        base, source, run_stage = dict(DEFAULTS), "built-in defaults", None
        why = ""
        if given["conditioning"] is None:
            has, why = _has_own_reward_tokens(model)
            base["conditioning"] = "high" if has else "none"
    values = {name: given[name] if given[name] is not None else base[name] for name in SETTINGS}
    return EvalSettings(**values, source=source, stage=run_stage, why_conditioning=why, from_flags=from_flags)


def evaluate_model(args) -> int:
    """--model: greedy rollouts of the policy on the chosen split, official verdicts."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    settings = resolve_eval_settings(args.model, args)
    print(settings.describe(), flush=True)
    from rcgrpo.evaluate import evaluate, named_entries, select_entries, write_eval
    from rcgrpo.models import load_tokenizer, resolve_model_folder
    from rcgrpo.rollout import make_engine

    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise SystemExit(f"unknown categories {unknown}; choose from {CATEGORIES}")
    entries = select_entries(args.split, categories, args.subset)
    if args.ids:
        wanted = [i.strip() for i in args.ids.split(",") if i.strip()]
        entries = named_entries(entries, wanted, "--ids", f"in the {args.split} split of {categories}")
    folder = resolve_model_folder(args.model)
    kwargs = {} if args.engine == "hf" else {"max_model_len": settings.max_total_tokens}
    engine = make_engine(args.engine, folder, **kwargs)
    result = evaluate(engine, load_tokenizer(folder), entries, settings.conditioning, greedy=True,
                      max_new_tokens=settings.max_new_tokens, max_total_tokens=settings.max_total_tokens,
                      doc_style=settings.doc_style)
    result["settings"] = {**result.get("settings", {}), **settings.to_dict()}
    out = args.out or Path("runs") / "eval" / "".join(c if c.isalnum() or c in "-_." else "_" for c in str(args.model))
    _, md_path = write_eval(result, out, str(args.model))
    print(md_path.read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors a user can fix are one line and exit code 2 (rcgrpo.errors)."""
    return run_command("rcgrpo.eval", eval_command, argv)


class _OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as one line too (rcgrpo.errors prints it, exit 2)."""

    def error(self, message: str):
        raise SystemExit(f"{message} (see --help)")


def eval_command(argv: list[str]) -> int:
    parser = _OneLineParser(prog="python -m rcgrpo.eval", description=__doc__,
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
    # None = not given: resolve_eval_settings fills them from the model's run, else the built-in defaults.
    parser.add_argument("--conditioning", choices=CONDITIONING_NAMES, default=None,
                        help="reward token in the prompt (default: the run's eval.conditioning for a stage trained "
                             "with reward tokens, else none; outside a run: high if the model has the tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: the run's eval.max_new_tokens, else 512")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="default: the run's grpo.max_total_tokens, else 8192")
    parser.add_argument("--doc-style", default=None, choices=["compact", "compact_no_response", "official"],
                        help="default: the run's data.doc_style, else compact")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--positional", choices=["drop", "bind"], default="drop",
                        help="drop positional arguments as the official decoder does (default), or bind them")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
