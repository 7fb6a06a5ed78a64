"""`rcgrpo-report --name NAME` (rcgrpo/report_cli.py): metrics.jsonl -> PNG plots + report.md.

Reads ``RUN_DIR/metrics.jsonl`` (written by ``rcgrpo.metrics``), draws

* ``reward.png``          mean reward of each step's rollouts, overall and per reward token,
* ``sampled_reward.png``  the learning curve: sampled reward on fixed training prompts (95% interval),
* ``steer.png``, ``p_expert.png``  RCTP: the reward token's effect at the first divergent token,
* ``zero_var_frac.png``   fraction of groups with zero reward variance,
* ``entropy.png``, ``kl.png``, and the other figures of ``FIGURES``,
* ``overview.png``        a grid of every numeric metric,

each against the step, one line per stage that logged it; and writes
``RUN_DIR/report.md`` with what the run learnt (``learning_summary``), a
per-stage summary, the plots, and the evaluation table when
``RUN_DIR/eval.json`` exists.

``eval.json``: ``{"categories": {"base": acc, ...}, "overall": acc, "macro": acc,
"n": {...}}`` with accuracies as fractions in [0, 1] (a file whose values
exceed 1 is read as already in %), optionally ``"method"``; or a list of such
objects, one table row each. "overall" is the accuracy over all entries (the
paper's), "macro" the unweighted mean of the categories. The table follows
the paper's layout: rows = method, columns base / miss_func / miss_param /
long_context / overall (+ the mean of categories), in %.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from rcgrpo import json_input
from rcgrpo.atomic import atomic_write_text
from rcgrpo.envs.data import CATEGORIES
from rcgrpo.errors import UserError
from rcgrpo.metrics import METRICS_FILE, STANDARD_METRICS, MetricsFileError, read_records
from rcgrpo.reward_tokens import HIGH_REWARD, LOW_REWARD

__all__ = ["write_report", "plot_metrics", "eval_table_markdown", "learning_summary", "ReportError", "main"]

EVAL_FILE = "eval.json"
REPORT_FILE = "report.md"
# One figure per headline quantity: its title, the unit on its y axis, and
# the series that share the axis.
FIGURES = {
    "reward": ("mean reward", "reward per rollout (0 or 1)", ["reward_mean", "reward_mean_high", "reward_mean_low"]),
    # The learning curve: one fixed sample of training prompts, 95% interval shaded.
    "sampled_reward": ("sampled reward on fixed training prompts (95% interval)", "share of rollouts with reward 1",
                       ["sampled_reward_high", "sampled_reward_low", "sampled_reward_none"]),
    "steer": ("RCTP: steer at the first divergent token", "nats", ["steer", "steer_logodds"]),
    "p_expert": ("RCTP: p(expert's token) at the first divergent token", "probability",
                 ["p_expert_high", "p_expert_low"]),
    "zero_var_frac": ("fraction of zero-variance groups", "share of the step's groups", ["zero_var_frac"]),
    "entropy": ("policy entropy", "nats per generated token", ["entropy"]),
    "kl": ("KL to reference", "nats per generated token (k3)", ["kl"]),
    # Rollout-trainer agreement: how far the engine's sampling log-probs are
    # from the trainer's pre-update ones over the sampled tokens.
    "logp_agreement": ("engine vs trainer log-probs", "nats",
                       ["logp_diff_abs_mean", "seq_log_ratio_mean", "seq_log_ratio_abs_max"]),
    "logp_agreement_share": ("share of tokens with |engine - trainer| > 0.1", "share of sampled tokens",
                             ["logp_diff_over_0.1_frac"]),
    "clip_frac": ("clipped share of tokens", "share of loss tokens", ["clip_frac", "clip_frac_pass1",
                                                                      "clip_frac_pass2"]),
    "dynamic_sampling": ("dynamic sampling per step", "count",
                         ["ds_prompts_drawn", "ds_groups_kept", "ds_groups_dropped"]),
}
SERIES_LABEL = {"reward_mean": "all rollouts", "reward_mean_high": HIGH_REWARD, "reward_mean_low": LOW_REWARD,
                "sampled_reward_high": HIGH_REWARD, "sampled_reward_low": LOW_REWARD,
                "sampled_reward_none": "no token", "steer": "log-prob difference", "steer_logodds": "log-odds",
                "p_expert_high": HIGH_REWARD, "p_expert_low": LOW_REWARD,
                "logp_diff_abs_mean": "mean |difference| per token",
                "seq_log_ratio_mean": "mean log-ratio per sequence",
                "seq_log_ratio_abs_max": "max |log-ratio| per sequence",
                "clip_frac": "all updates", "clip_frac_pass1": "pass 1", "clip_frac_pass2": "pass 2",
                "ds_prompts_drawn": "prompts drawn", "ds_groups_kept": "groups kept",
                "ds_groups_dropped": "groups dropped"}
METHOD_NAMES = {"rctp+rc-grpo": "RCTP + RC-GRPO", "rctp+grpo": "RCTP + GRPO", "sft+grpo": "SFT + GRPO",
                "sft+rc-grpo": "SFT + RC-GRPO", "sft+grpo-ds": "SFT + GRPO (dynamic sampling)"}


class ReportError(UserError, RuntimeError):
    """The run folder lacks what a report needs (the message says what)."""


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    return _numeric(v) and math.isfinite(v)


def _series(records: list[dict], key: str) -> dict[Optional[str], tuple[list[int], list[float]]]:
    """stage -> (steps, values) for one metric, in file order; NaN kept (gaps)."""
    out: dict = {}
    for r in records:
        v = r.get(key)
        if _numeric(v):
            xs, ys = out.setdefault(r.get("stage"), ([], []))
            xs.append(r["step"])
            ys.append(float(v))
    return out


def _numeric_keys(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in ("step", "time") and _numeric(v):
                seen.setdefault(k, None)
    known = [k for k in STANDARD_METRICS if k in seen]
    return known + sorted(k for k in seen if k not in STANDARD_METRICS)


def plot_metrics(records: list[dict], out_dir: str | os.PathLike) -> list[Path]:
    """Write the PNGs for whichever figures have data; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(out_dir)
    written = []

    def draw(ax, key: str, series_label: str = "") -> bool:
        series = _series(records, key)
        for stage, (xs, ys) in series.items():
            parts = [series_label] if series_label else []
            if len(series) > 1 or not parts:
                parts.append(stage or "run")
            line, = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=" / ".join(parts))
            band = [_series(records, f"{key}_{end}").get(stage) for end in ("lo", "hi")]
            if all(band) and band[0][0] == band[1][0]:  # an interval logged with the value: shade it
                ax.fill_between(band[0][0], band[0][1], band[1][1], color=line.get_color(), alpha=0.2)
        return bool(series)

    for name, (title, unit, keys) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        drew = False
        for key in keys:
            drew |= draw(ax, key, SERIES_LABEL.get(key, "") if len(keys) > 1 else "")
        if drew:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(unit)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
            ax.grid(alpha=0.3)
            if name in ("reward", "zero_var_frac", "sampled_reward", "p_expert"):
                ax.set_ylim(-0.05, 1.05)  # both live in [0, 1]: keep runs comparable
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path)
            written.append(path)
        plt.close(fig)

    keys = _numeric_keys(records)
    if keys:
        cols = min(3, len(keys))
        rows = math.ceil(len(keys) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), dpi=100, squeeze=False)
        for ax, key in zip(axes.flat, keys):
            draw(ax, key)
            stages = list(_series(records, key))
            ax.set_title(key if len(stages) != 1 else f"{key} ({stages[0] or 'run'})", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if len(_series(records, key)) > 1:
                ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        fig.tight_layout()
        path = out_dir / "overview.png"
        fig.savefig(path)
        written.append(path)
        plt.close(fig)
    return written


def _pct(x) -> str:
    return "-" if x is None or not _numeric(x) else f"{x:.2f}"


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
        scale = 1.0 if any(_numeric(v) and v > 1.0 for v in values) else 100.0
        cells = [_pct(v * scale if _numeric(v) else None) for v in values]
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


def _run_method(run_dir: Path) -> str:
    cfg_path = run_dir / "config.json"
    try:
        pipeline = json_input.loads(cfg_path.read_text())["run"]["pipeline"]
        return METHOD_NAMES.get(pipeline, pipeline)
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name


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
            ys = [float(r[key]) for r in recs if _numeric(r.get(key)) and math.isfinite(r[key])]
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
        steer = [r for r in recs if all(_finite(r.get(k)) for k in ("steer", "p_expert_high", "p_expert_low"))]
        if len(steer) > 1:
            a, b = steer[0], steer[-1]
            lines.append(f"[{stage}] steer at the first divergent token: {a['steer']:+.3f} nats (step {a['step']}) "
                         f"-> {b['steer']:+.3f} (step {b['step']}); p(expert's token) under high / low "
                         f"{b['p_expert_high']:.2f} / {b['p_expert_low']:.2f}")
        for name in ("high", "low", "none"):
            key = f"sampled_reward_{name}"
            probes = [r for r in recs if _finite(r.get(key)) and 0 <= r[key] <= 1 and _finite(r.get(f"{key}_n"))
                      and r[f"{key}_n"] >= 1]
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
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir} does not exist")
    try:
        records, problems = read_records(run_dir / METRICS_FILE)
    except MetricsFileError as e:
        raise ReportError(str(e)) from e
    if not records:
        raise ReportError(f"{run_dir / METRICS_FILE} has no metric records")
    method = _run_method(run_dir)
    plots = plot_metrics(records, run_dir)

    md = [f"# Run report: {run_dir.name}", "", f"Method: {method}.", ""]
    if problems:
        md += ["Notes on the metrics file:", ""] + [f"- {p}" for p in problems] + [""]
    eval_path = run_dir / EVAL_FILE
    if eval_path.is_file():
        md += ["## Evaluation (accuracy, %)", "", eval_table_markdown(_read_eval(eval_path), method), ""]
    else:
        md += ["## Evaluation", "", f"No {EVAL_FILE} in this run folder yet.", ""]
    learnt = learning_summary(records)
    if learnt:
        md += ["## What it learnt", "", *[f"- {line}" for line in learnt], ""]
    md += ["## Training dynamics", ""]
    md += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    md += ["## Per-stage summary", ""] + _stage_summary(records)
    return atomic_write_text(run_dir / REPORT_FILE, "\n".join(md))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`rcgrpo-report` (its command line: rcgrpo/report_cli.py)."""
    from rcgrpo.report_cli import main as report_main

    return report_main(argv)


if __name__ == "__main__":
    sys.exit(main())
