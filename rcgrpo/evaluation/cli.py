"""`rcgrpo-eval` (`python -m rcgrpo.eval`): score BFCL multi-turn runs.

What to evaluate (exactly one):
  --model PATH                           a policy (a run's models/<stage>
      folder, any HF folder, a hub id, or "embedded:smollm2-135m-instruct"):
      one greedy rollout per entry of the test split; prints the table and
      writes eval.json / eval.md into --out (default: runs/eval/<model name>).
  --replay FILE.jsonl --out OUT.jsonl    score recorded call strings; each input
      line is {"id": ..., "turns": [[[calls of step 1], [calls of step 2]], ...]}
      (BFCL's result-file structure); each output line is
      {"id", "valid", "r_state", "r_action", "reward"} in input order, or
      {"line", "id", "error"} for a line that could not be scored.
  --ground-truth                         replay every ground truth and print
      per-category and overall accuracy.

The settings are the keys of a run's config.toml that evaluation reads,
written as rcgrpo-train writes them (rcgrpo/base/command_line.py): --eval.subset 5,
--eval.max_new_tokens=96. For a run's runs/<name>/models/<stage> folder, that
run's config.toml supplies eval.max_new_tokens, grpo.max_total_tokens and
data.doc_style, and eval.conditioning when the stage's policy was trained
with reward tokens (rctp, rc-grpo, and grpo after rctp), else none (sft, and
grpo after sft). Any other model: 512 / 8192 / compact, and conditioning
high for a folder or hub id (owner/name[@revision], such as a stage pushed
with run.push_to_hub) whose tokenizer already has <|high_reward|>, none for
the embedded model or a model without the tokens (they never saw them). A
flag always wins. One line says where the settings came from; eval.json
records them under "settings". A run config that cannot be read is an error
(exit 2).
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from rcgrpo.base.command_line import CommandLineError, Section, format_help, read_flags, split_argv
from rcgrpo.base.errors import DEBUG_ENV, run_command
from rcgrpo.conditioning.prompts import DOC_STYLES
from rcgrpo.conditioning.reward_tokens import CONDITIONING_NAMES
from rcgrpo.envs.data import CATEGORIES
from rcgrpo.evaluation.replay_scoring import ground_truth_table, print_table, score_replay_file
from rcgrpo.evaluation.settings import DEFAULTS, resolve_eval_settings
from rcgrpo.rollout import ENGINES

PROG = "rcgrpo.eval"
# The keys of a run's config this command takes (names and limits as
# rcgrpo-train's) -> the attribute they fill; unset ones of the last four
# are resolved from the model's run (rcgrpo/evaluation/settings.py).
SETTINGS = {
    "model.name_or_path": "model", "eval.split": "split", "eval.subset": "subset",
    "eval.categories": "categories", "run.engine": "engine", "eval.conditioning": "conditioning",
    "eval.max_new_tokens": "max_new_tokens", "grpo.max_total_tokens": "max_total_tokens",
    "data.doc_style": "doc_style",
}
ALIASES = {"model": "model.name_or_path", "split": "eval.split", "subset": "eval.subset",
           "categories": "eval.categories", "conditioning": "eval.conditioning", "engine": "run.engine"}
# Spellings of the argparse days -> their key now (one deprecation line each).
OLD = {"max-new-tokens": "eval.max_new_tokens", "max-total-tokens": "grpo.max_total_tokens",
       "doc-style": "data.doc_style"}
# The command's own flags (not settings of a run) -> their type.
COMMAND = {"replay": str, "ground-truth": bool, "out": str, "ids": list[str], "positional": str}
MODES = ("model.name_or_path", "replay", "ground-truth")
POSITIONAL = ("drop", "bind")


def evaluate_model(args) -> int:
    """--model: greedy rollouts of the policy on the chosen split, official verdicts."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rcgrpo.model import hub

    if not Path(args.model).expanduser().exists() and hub.is_hub_id(args.model):
        hub.download(args.model)  # first: the settings read its tokenizer from the cache
    settings = resolve_eval_settings(args.model, args)
    print(settings.describe(), flush=True)
    from rcgrpo.evaluation.rollouts import evaluate, named_entries, select_entries, write_eval
    from rcgrpo.model.loading import load_tokenizer, resolve_model_folder
    from rcgrpo.rollout import make_engine
    from rcgrpo.rollout.agent_loop import RolloutConfig

    categories = args.categories
    entries = select_entries(args.split, categories, args.subset)
    if args.ids is not None:
        entries = named_entries(entries, args.ids, "--ids", f"in the {args.split} split of {categories}")
    folder = resolve_model_folder(args.model)
    kwargs = {} if args.engine == "hf" else {"max_model_len": settings.max_total_tokens}
    engine = make_engine(args.engine, folder, **kwargs)
    greedy = RolloutConfig(max_new_tokens=settings.max_new_tokens, max_total_tokens=settings.max_total_tokens,
                           temperature=0.0, doc_style=settings.doc_style)
    result = evaluate(engine, load_tokenizer(folder), entries, settings.conditioning, greedy)
    result["settings"] = {**result.get("settings", {}), **settings.to_dict()}
    out = args.out or Path("runs") / "eval" / "".join(c if c.isalnum() or c in "-_." else "_" for c in str(args.model))
    _, md_path = write_eval(result, out, str(args.model))
    print(md_path.read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors a user can fix are one line and exit code 2 (rcgrpo.base.errors)."""
    return run_command(PROG, eval_command, argv)


def usage() -> str:
    cats = ",".join(CATEGORIES)
    return format_help([
        "usage: rcgrpo-eval (--model PATH | --replay FILE.jsonl --out OUT.jsonl | --ground-truth) "
        "[--section.key VALUE ...]",
        "       (the same: python -m rcgrpo.eval)",
        "",
        "Scores BFCL multi-turn runs. Settings are the keys of a run's config.toml, written as rcgrpo-train "
        "writes them: --eval.subset 5 or --eval.subset=5; a list is comma-separated. For a run's "
        "models/<stage> folder the unset ones come from that run's config.toml, else the defaults below; "
        "a flag always wins, and one line says where each came from. Errors are one line (exit code 2).",
    ], [
        Section("what to evaluate (exactly one)", "", [
            ("--model PATH", "", "a policy: a run's models/<stage> folder, an HF folder, a hub id, or "
             "embedded:smollm2-135m-instruct (= --model.name_or_path)"),
            ("--replay FILE.jsonl", "", "score recorded call strings (needs --out)"),
            ("--ground-truth", "", "replay every ground truth; print per-category and overall accuracy"),
        ]),
        Section("settings", "", [
            ("--eval.split STR", "= test", "test (80 entries) or train (shortcut --split)"),
            ("--eval.subset INT", "= none", "the first N entries of each category; none = all (shortcut --subset)"),
            ("--eval.categories LIST", f"= {cats}", "comma-separated (shortcut --categories)"),
            ("--eval.conditioning STR", "= auto", f"reward token in the prompt, one of {CONDITIONING_NAMES}; auto: "
             "the run's eval.conditioning for a stage trained with reward tokens, else none; outside a run "
             "high if the model has the tokens (shortcut --conditioning)"),
            ("--eval.max_new_tokens INT", f"= the run's, else {DEFAULTS['max_new_tokens']}",
             "max tokens per assistant step (was --max-new-tokens)"),
            ("--grpo.max_total_tokens INT", f"= the run's, else {DEFAULTS['max_total_tokens']}",
             "max tokens of a whole trajectory, the run's trajectory limit (was --max-total-tokens)"),
            ("--data.doc_style STR", f"= the run's, else {DEFAULTS['doc_style']}",
             f"function docs in the system prompt, one of {DOC_STYLES} (was --doc-style)"),
            ("--run.engine STR", "= auto", f"rollout engine, one of {ENGINES} (shortcut --engine)"),
        ]),
        Section("command", "", [
            ("--out PATH", "", "--replay: the output JSONL; --model: the output folder "
             "(default runs/eval/<model name>)"),
            ("--ids LIST", "", "--model: only these comma-separated entry ids of the split"),
            ("--positional STR", "= drop", "--replay: drop positional arguments as the official decoder "
             "does, or bind them"),
            ("--debug", "", f"show tracebacks (also {DEBUG_ENV}=1)"),
            ("-h, --help", "", "this help"),
        ]),
    ])


def read_command_line(argv: list[str]) -> SimpleNamespace:
    """argv -> the command's values, each setting checked against the limits
    the schema gives it (rcgrpo/config/schema.py) before any model loads."""
    flags = split_argv(argv)
    known: dict[str, object] = dict(COMMAND)
    if any(f.key not in COMMAND for f in flags):
        # The schema's types come with torch (rcgrpo.config): only a command
        # line naming a setting pays for them, `--replay` never does.
        from rcgrpo.config.io import KEYS

        known.update({key: KEYS[key][0] for key in SETTINGS})
    given = read_flags(PROG, flags, known, ALIASES, OLD)
    args = SimpleNamespace(model=None, replay=None, ground_truth=False, out=None, split="test", subset=None,
                           categories=list(CATEGORIES), ids=None, positional="drop", engine="auto",
                           **{name: None for name in ("conditioning", "max_new_tokens", "max_total_tokens",
                                                      "doc_style")})
    problems, seen = [], set()
    for key, value, flag in given:
        name = flag.split("=", 1)[0]
        if key in seen:
            raise CommandLineError(f"{name} given twice")
        seen.add(key)
        if key in SETTINGS or key == "ids":
            from rcgrpo.config.validation import setting_problems

            problems += setting_problems("data.entry_ids" if key == "ids" else key, value, name)
        elif key in ("replay", "out") and not value.strip():
            problems.append(f"{name} must not be an empty string")
        elif key == "positional" and value not in POSITIONAL:
            problems.append(f"{name} must be one of {POSITIONAL}, got {value!r}")
        setattr(args, SETTINGS.get(key, key.replace("-", "_")), value)
    if problems:
        raise CommandLineError("; ".join(problems))
    if args.conditioning == "auto":
        args.conditioning = None  # resolved from the model's run, as when not given
    modes = [m for m in MODES if m in seen and (m != "ground-truth" or args.ground_truth)]
    if len(modes) != 1:
        raise CommandLineError("give exactly one of --model, --replay, --ground-truth (see --help)")
    if args.replay is not None and args.out is None:
        raise CommandLineError("--replay needs --out")
    args.replay, args.out = (Path(p) if p is not None else None for p in (args.replay, args.out))
    return args


def eval_command(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage(), end="")
        return 0
    args = read_command_line(argv)
    if args.replay:
        scored, errors = score_replay_file(args.replay, args.out, args.positional)
        print(f"scored {scored} entries, {errors} error lines -> {args.out}")
        return 0
    if args.model:
        return evaluate_model(args)
    print_table(*ground_truth_table())
    return 0


__all__ = ["main", "eval_command", "read_command_line", "usage", "evaluate_model"]
