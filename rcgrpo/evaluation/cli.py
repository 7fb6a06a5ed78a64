"""`python -m rcgrpo.eval`: score BFCL multi-turn runs.

  --replay FILE.jsonl --out OUT.jsonl   score recorded call strings; each input
      line is {"id": ..., "turns": [[[calls of step 1], [calls of step 2]], ...]}
      (BFCL's result-file structure); each output line is
      {"id", "valid", "r_state", "r_action", "reward"} in input order, or
      {"line", "id", "error"} for a line that could not be scored.
  --ground-truth                         replay every ground truth and print
      per-category and overall accuracy.
  --model PATH                           evaluate a policy (a run's models/<stage>
      folder, any HF folder, a hub id owner/name[@revision] such as a stage
      pushed with run.push_to_hub, or "embedded:smollm2-135m-instruct"): one greedy
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
  any other model: 512 / 8192 / compact, and --conditioning high for a folder
      or hub id whose tokenizer already has <|high_reward|>, none for the
      embedded model or a model without the tokens (they never saw them).
  One line says where the settings came from; eval.json records them under
  "settings". A run config that cannot be read is an error (exit 2).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from rcgrpo.envs.data import CATEGORIES
from rcgrpo.errors import DEBUG_ENV, DEBUG_FLAG, run_command
from rcgrpo.evaluation.replay_scoring import ground_truth_table, print_table, score_replay_file
from rcgrpo.evaluation.settings import resolve_eval_settings
from rcgrpo.prompts import DOC_STYLES
from rcgrpo.reward_tokens import CONDITIONING_NAMES
from rcgrpo.rollout import ENGINES


def evaluate_model(args) -> int:
    """--model: greedy rollouts of the policy on the chosen split, official verdicts."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rcgrpo import hub

    if not Path(args.model).expanduser().exists() and hub.is_hub_id(args.model):
        hub.download(args.model)  # first: the settings read its tokenizer from the cache
    settings = resolve_eval_settings(args.model, args)
    print(settings.describe(), flush=True)
    from rcgrpo.evaluation.rollouts import evaluate, named_entries, select_entries, write_eval
    from rcgrpo.models import load_tokenizer, resolve_model_folder
    from rcgrpo.rollout import make_engine

    categories = args.categories
    entries = select_entries(args.split, categories, args.subset)
    if args.ids is not None:
        entries = named_entries(entries, args.ids, "--ids", f"in the {args.split} split of {categories}")
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


def _setting(key: str, flag: str, tp: type = int):
    """An argparse type for the flag that stands for the setting `key`: a
    value within the limits the schema gives that setting (rcgrpo/config.py),
    checked as the command line is read, before any model loads."""
    from rcgrpo.config_validation import setting_problems

    def parse(text: str):
        if tp is list:  # comma-separated names; empty items are kept, so that they are refused
            value = [n.strip() for n in text.split(",")] if text.strip() else []
        else:
            try:
                value = tp(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"invalid {tp.__name__} value: {text!r}") from None
        problems = setting_problems(key, value, flag)
        if problems:
            raise argparse.ArgumentTypeError("; ".join(problems))
        return value

    return parse


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be an empty string")
    return text


def _path(text: str) -> Path:
    """A file or folder argument: "" would be the working directory (Path("")
    is "."), never what was meant."""
    return Path(_nonempty(text))


class _OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as one line too (rcgrpo.errors prints it, exit 2)."""

    def error(self, message: str):
        raise SystemExit(f"{message} (see --help)")


def eval_command(argv: list[str]) -> int:
    parser = _OneLineParser(prog="python -m rcgrpo.eval", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--replay", type=_path, metavar="FILE.jsonl")
    mode.add_argument("--ground-truth", action="store_true")
    mode.add_argument("--model", type=_nonempty, metavar="PATH")
    parser.add_argument("--out", type=_path, metavar="OUT", help="--replay: output JSONL; --model: output folder")
    parser.add_argument("--split", choices=["test", "train"], default="test")
    parser.add_argument("--subset", type=_setting("eval.subset", "--subset"), default=None,
                        help="first N entries of each category (N >= 1)")
    parser.add_argument("--categories", type=_setting("eval.categories", "--categories", list),
                        default=list(CATEGORIES),
                        help=f"comma-separated, of {','.join(CATEGORIES)} (default: all)")
    parser.add_argument("--ids", type=_setting("data.entry_ids", "--ids", list), default=None,
                        help="--model: only these comma-separated entry ids of the split")
    # None = not given: resolve_eval_settings fills them from the model's run, else the built-in defaults.
    parser.add_argument("--conditioning", choices=CONDITIONING_NAMES, default=None,
                        help="reward token in the prompt (default: the run's eval.conditioning for a stage trained "
                             "with reward tokens, else none; outside a run: high if the model has the tokens)")
    parser.add_argument("--max-new-tokens", type=_setting("eval.max_new_tokens", "--max-new-tokens"),
                        default=None,
                        help="default: the run's eval.max_new_tokens, else 512")
    parser.add_argument("--max-total-tokens", type=_setting("grpo.max_total_tokens", "--max-total-tokens"),
                        default=None,
                        help="default: the run's grpo.max_total_tokens, else 8192")
    parser.add_argument("--doc-style", default=None, choices=DOC_STYLES,
                        help="default: the run's data.doc_style, else compact")
    parser.add_argument("--engine", choices=ENGINES, default="auto")
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
    print_table(*ground_truth_table())
    return 0
