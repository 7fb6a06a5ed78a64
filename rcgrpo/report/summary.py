"""`rcgrpo-report --name NAME` (rcgrpo/report/cli.py): metrics.jsonl -> PNG plots + report.md.

Reads ``RUN_DIR/metrics.jsonl`` (written by ``rcgrpo.run.metrics``), saves the
figures of ``rcgrpo.report.plots`` (``dashboard.png``: is RL working; one PNG per
stage: what its updates did; ``speed.png``) and writes ``RUN_DIR/report.md``
with what the run learnt (``learning_summary``), the plots, a per-stage
summary of every metric, and the evaluation table when ``RUN_DIR/eval.json``
exists.

``eval.json``: ``{"categories": {"base": acc, ...}, "overall": acc, "macro": acc,
"n": {...}}`` with accuracies as fractions in [0, 1] (a file whose values
exceed 1 is read as already in %), optionally ``"method"``; or a list of such
objects, one table row each. "overall" is the accuracy over all entries (the
paper's), "macro" the unweighted mean of the categories. The table follows
the paper's layout: rows = method, columns base / miss_func / miss_param /
long_context / overall (+ the mean of categories), in %.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from rcgrpo.base import json_input
from rcgrpo.base.atomic import atomic_write_text
from rcgrpo.base.errors import UserError
from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.envs.data import CATEGORIES
from rcgrpo.run.folder import RunFolder
from rcgrpo.run.metrics import (
    STANDARD_METRICS,
    MetricsFileError,
    is_finite_number,
    is_number,
    read_records,
)

__all__ = ["write_report", "plot_metrics", "eval_table_markdown", "learning_summary", "ReportError"]

# PNG names earlier versions of the report wrote, one per metric or a grid of
# all of them; a redraw removes them, so a run folder shows only today's set.
FORMER_FIGURES = ("reward", "sampled_reward", "steer", "p_expert", "zero_var_frac", "entropy", "kl",
                  "logp_agreement", "logp_agreement_share", "clip_frac", "dynamic_sampling", "overview")
METHOD_NAMES = {"rctp+rc-grpo": "RCTP + RC-GRPO", "rctp+grpo": "RCTP + GRPO", "sft+grpo": "SFT + GRPO",
                "sft+rc-grpo": "SFT + RC-GRPO", "sft+grpo-ds": "SFT + GRPO (dynamic sampling)"}


class ReportError(UserError, RuntimeError):
    """The run folder lacks what a report needs (the message says what)."""


def _numeric_keys(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", "time") and is_number(v):
                seen.setdefault(k, None)
    known = [k for k in STANDARD_METRICS if k in seen]
    return known + sorted(k for k in seen if k not in STANDARD_METRICS)


def plot_metrics(records: list[dict], out_dir: str | os.PathLike, run_name: str = "") -> list[Path]:
    """Save ``rcgrpo.report.plots.run_figures`` as ``<name>.png`` in ``out_dir``
    (and remove the former set's PNGs); return the paths written."""
    from rcgrpo.report.plots import run_figures

    out_dir = Path(out_dir)
    for name in FORMER_FIGURES:
        (out_dir / f"{name}.png").unlink(missing_ok=True)
    written = []
    for name, fig in run_figures(records, run_name).items():
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written


def _pct(x) -> str:
    return "-" if x is None or not is_number(x) else f"{x:.2f}"


def eval_table_markdown(rows: Sequence[dict], default_method: str = "this run") -> str:
    """The paper-style table (accuracy in %) for one or more eval results:
    per category, overall (over all entries, the paper's) and the unweighted
    mean of the categories (a row without "macro" shows "-" there)."""
    head = "| method | " + " | ".join(CATEGORIES) + " | overall | mean of categories |"
    lines = [head, "|" + "---|" * (len(CATEGORIES) + 3)]
    ns: dict = {}
    for row in rows:
        cats = row.get("categories") or {}
        values = [cats.get(c) for c in CATEGORIES] + [row.get("overall"), row.get("macro")]
        # Fractions are the documented form; a row already in % is left as is.
        scale = 1.0 if any(is_number(v) and v > 1.0 for v in values) else 100.0
        cells = [_pct(v * scale if is_number(v) else None) for v in values]
        lines.append(f"| {row.get('method') or default_method} | " + " | ".join(cells) + " |")
        ns = ns or (row.get("n") if isinstance(row.get("n"), dict) else {})
    if ns:
        lines.append("")
        lines.append("Entries evaluated: " + ", ".join(f"{k} {v}" for k, v in ns.items()) + ".")
    return "\n".join(lines)


def _read_eval(path: Path) -> list[dict]:
    try:
        data = json_input.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path} is not readable JSON: {e}") from e
    rows = data if isinstance(data, list) else [data]
    for r in rows:
        if not isinstance(r, dict) or not isinstance(r.get("categories"), dict):
            raise ReportError(f"{path}: expected {{'categories': {{...}}, 'overall': ...}} (or a list of them)")
    return rows


def _run_method(folder: RunFolder) -> str:
    try:
        pipeline = json_input.loads(folder.config_json.read_text())["run"]["pipeline"]
        return METHOD_NAMES.get(pipeline, pipeline)
    except (OSError, ValueError, KeyError, TypeError):
        return folder.name


def _stage_summary(records: list[dict]) -> list[str]:
    stages: dict = {}
    for r in records:
        stages.setdefault(r.get("stage"), []).append(r)
    lines = []
    for stage, recs in stages.items():
        steps = [r["step"] for r in recs]
        lines.append(f"### {stage or 'run'}: {len(recs)} records, steps {min(steps)}-{max(steps)}")
        lines.append("")
        lines.append("| metric | first | last | min | max |")
        lines.append("|---|---|---|---|---|")
        for key in _numeric_keys(recs):
            ys = [float(r[key]) for r in recs if is_finite_number(r.get(key))]
            if ys:
                lines.append(f"| {key} | {ys[0]:.4g} | {ys[-1]:.4g} | {min(ys):.4g} | {max(ys):.4g} |")
        lines.append("")
    return lines


def learning_summary(records: list[dict]) -> list[str]:
    """What the run learnt, one line per measure: each RL stage's sampled
    reward on its fixed training prompts, first and last measurement per
    reward token, with the change's 95% interval (Newcombe); each RCTP
    stage's steer at the first divergent token, first and last. [] when no
    stage measured either."""
    from rcgrpo.evaluation.stats import Rate, difference

    lines = []
    stages: dict = {}
    for r in records:
        stages.setdefault(r.get("stage"), []).append(r)
    for stage, recs in stages.items():
        steer = [r for r in recs if all(is_finite_number(r.get(k)) for k in ("steer", "p_expert_high", "p_expert_low"))]
        if len(steer) > 1:
            a, b = steer[0], steer[-1]
            lines.append(f"[{stage}] steer at the first divergent token: {a['steer']:+.3f} nats (step {a['step']}) "
                         f"-> {b['steer']:+.3f} (step {b['step']}); p(expert's token) under high / low "
                         f"{b['p_expert_high']:.2f} / {b['p_expert_low']:.2f}")
        for name in ("high", "low", "none"):
            key = f"sampled_reward_{name}"
            probes = [r for r in recs if is_finite_number(r.get(key)) and 0 <= r[key] <= 1
                      and is_finite_number(r.get(f"{key}_n")) and r[f"{key}_n"] >= 1]
            if len(probes) < 2:
                continue
            first, last = (Rate(round(p[key] * p[f"{key}_n"]), int(p[f"{key}_n"])) for p in (probes[0], probes[-1]))
            d, (lo, hi) = difference(last, first)
            label = {"high": HIGH_REWARD, "low": LOW_REWARD, "none": "no reward token"}[name]
            lines.append(f"[{stage}] sampled reward on its training prompts under {label}: {first} at step "
                         f"{probes[0]['step']} -> {last} at step {probes[-1]['step']}; change {d:+.3f} "
                         f"[{lo:+.3f}, {hi:+.3f}]")
    return lines


def write_report(run_dir: str | os.PathLike) -> Path:
    """Plots + ``report.md`` for a run; returns the markdown path.

    Raises ReportError for a missing, empty or corrupt metrics file or an
    unreadable eval.json.
    """
    run_dir = Path(run_dir)
    folder = RunFolder(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir} does not exist")
    try:
        records, problems = read_records(folder.metrics)
    except MetricsFileError as e:
        raise ReportError(str(e)) from e
    if not records:
        raise ReportError(f"{folder.metrics} has no metric records")
    method = _run_method(folder)
    plots = plot_metrics(records, run_dir, run_dir.name)

    md = [f"# Run report: {run_dir.name}", "", f"Method: {method}.", ""]
    if problems:
        md += ["Notes on the metrics file:", ""] + [f"- {p}" for p in problems] + [""]
    eval_path = folder.eval_json
    if eval_path.is_file():
        md += ["## Evaluation (accuracy, %)", "", eval_table_markdown(_read_eval(eval_path), method), ""]
    else:
        md += ["## Evaluation", "", f"No {RunFolder.EVAL_JSON} in this run folder yet.", ""]
    learnt = learning_summary(records)
    if learnt:
        md += ["## What it learnt", "", *[f"- {line}" for line in learnt], ""]
    md += ["## Training dynamics", ""]
    md += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    md += ["## Per-stage summary", ""] + _stage_summary(records)
    return atomic_write_text(folder.report, "\n".join(md))

