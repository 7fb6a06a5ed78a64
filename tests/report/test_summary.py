"""rcgrpo.report.summary: plots and markdown from a synthetic run folder."""

from __future__ import annotations

import json
import math
import random

import pytest

from rcgrpo.report.cli import main
from rcgrpo.report.summary import ReportError, eval_table_markdown, write_report
from rcgrpo.run.metrics import MetricsLogger


def run_flags(run_dir):
    """rcgrpo-report's flags for the run folder `run_dir`."""
    return ["--name", run_dir.name, "--out-dir", str(run_dir.parent)]


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_run(run_dir, with_eval=True):
    rnd = random.Random(0)
    with MetricsLogger(run_dir, stage="rctp") as log:
        for s in range(1, 11):
            log.log(s, loss=2.0 / s, lr=1e-5, grad_norm=1 + rnd.random())
    with MetricsLogger(run_dir, stage="rc-grpo") as log:
        for s in range(1, 41):
            hi, lo = min(1, 0.2 + s / 50 + 0.1 * rnd.random()), 0.1 * rnd.random()
            log.log(s, reward_mean=(hi + lo) / 2, reward_mean_high=hi, reward_mean_low=lo,
                    zero_var_frac=0.6 * math.exp(-s / 15), entropy=1.5 - s / 40, kl=0.001 * s,
                    clip_frac=0.02, adv_std=0.8, tokens_per_s=500 + rnd.random() * 50,
                    logp_diff_abs_mean=1e-4 * (1 + rnd.random()), seq_log_ratio_mean=0.01 * rnd.random(),
                    seq_log_ratio_abs_max=0.02 + 0.01 * rnd.random(), **{"logp_diff_over_0.1_frac": 0.0})
    (run_dir / "config.json").write_text(json.dumps({"run": {"pipeline": "rctp+rc-grpo"}}))
    if with_eval:
        (run_dir / "eval.json").write_text(json.dumps({
            "categories": {"base": 0.5, "miss_func": 0.25, "miss_param": 0.0, "long_context": 1 / 23},
            "overall": 0.2, "n": {"base": 2, "miss_func": 4, "miss_param": 1, "long_context": 23}}))


def test_report_writes_valid_pngs_and_markdown(tmp_path):
    from PIL import Image

    synthetic_run(tmp_path)
    (tmp_path / "overview.png").write_bytes(PNG_MAGIC)  # drawn by an earlier version of the report
    assert main(run_flags(tmp_path)) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["dashboard.png", "rc-grpo.png", "rctp.png",
                                                               "speed.png"]
    for name in ("dashboard", "rctp", "rc-grpo", "speed"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        with Image.open(png) as im:
            im.verify()
        with Image.open(png) as im:
            assert im.size[0] > 300 and im.size[1] > 200
            # Not a blank canvas: lines were drawn.
            assert len(im.convert("L").getcolors(maxcolors=1 << 16)) > 10
    md = (tmp_path / "report.md").read_text()
    assert "| method | base | miss_func | miss_param | long_context | overall | mean of categories |" in md
    assert "| RCTP + RC-GRPO | 50.00 | 25.00 | 0.00 | 4.35 | 20.00 | - |" in md
    assert "![dashboard](dashboard.png)" in md and "### rc-grpo: 40 records, steps 1-40" in md


def test_learning_curves_and_the_steer_are_plotted(tmp_path):
    """The RL stage's sampled reward (with its 95% interval shaded) and
    RCTP's steer at the first divergent token are drawn."""
    from PIL import Image

    with MetricsLogger(tmp_path, stage="rctp") as log:
        for s in range(4):
            log.log(s, steer=0.5 * s, steer_logodds=0.8 * s, p_expert_high=0.5 + 0.1 * s, p_expert_low=0.5 - 0.1 * s)
    with MetricsLogger(tmp_path, stage="rc-grpo") as log:
        for s in (0, 5, 10):
            for name, base in (("high", 0.4), ("low", 0.2)):
                mean = base + 0.02 * s
                log.log(s, **{f"sampled_reward_{name}": mean, f"sampled_reward_{name}_lo": mean - 0.1,
                              f"sampled_reward_{name}_hi": mean + 0.1, f"sampled_reward_{name}_n": 64})
    md = write_report(tmp_path).read_text()
    assert "## What it learnt" in md
    assert "[rctp] steer at the first divergent token: +0.000 nats (step 0) -> +1.500 (step 3)" in md
    # 0.4 of 64 (26 rollouts, rounded) at step 0, 0.6 (38) at step 10: the change and its 95% interval
    assert "[rc-grpo] sampled reward on its training prompts under <|high_reward|>: 0.406 [" in md
    assert "at step 10; change +0.188 [" in md
    for name in ("dashboard", "rctp"):
        with Image.open(tmp_path / f"{name}.png") as im:
            assert len(im.convert("L").getcolors(maxcolors=1 << 16)) > 10


def test_report_without_eval_or_rl_metrics(tmp_path):
    with MetricsLogger(tmp_path, stage="sft") as log:
        for s in (1, 2):
            log.log(s, loss=1.0 / s)
    out = write_report(tmp_path)
    assert "No eval.json" in out.read_text()
    assert (tmp_path / "sft.png").is_file() and not (tmp_path / "dashboard.png").exists()


def test_eval_table_accepts_percent_and_several_rows():
    table = eval_table_markdown([
        {"method": "base model", "categories": {"base": 11.25}, "overall": 11.25},
        {"method": "RCTP + RC-GRPO", "categories": {"base": 0.85, "miss_func": 0.8}, "overall": 0.85},
    ])
    assert "| base model | 11.25 | - | - | - | 11.25 | - |" in table
    assert "| RCTP + RC-GRPO | 85.00 | 80.00 | - | - | 85.00 | - |" in table


def test_records_of_the_wrong_types_are_skipped_or_refused_in_one_line(tmp_path, capsys):
    """A metrics file is read back from disk: any value can be anything.
    Wrong-typed values are left out of the report; a line that is not a
    record (deep nesting included) is one line of error and exit 2."""
    synthetic_run(tmp_path, with_eval=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for odd in [{"step": 50, "stage": "rc-grpo", "reward_mean": "high", "kl": [1], "loss": {"a": 1}},
                    {"step": 51, "stage": "rc-grpo", "steer": 0.5, "p_expert_high": "x", "p_expert_low": None},
                    {"step": 52, "stage": "rc-grpo", "sampled_reward_high": 1e308 * 10, "sampled_reward_high_n": 8},
                    {"step": 53, "stage": "rc-grpo", "sampled_reward_low": 0.5, "sampled_reward_low_n": "8"},
                    {"step": 54, "stage": "rc-grpo", "sampled_reward_low": 0.5, "sampled_reward_low_n": 8}]:
            f.write(json.dumps(odd) + "\n")
    (tmp_path / "eval.json").write_text(json.dumps({"categories": {"base": "half"}, "overall": None, "n": [1]}))
    assert main(run_flags(tmp_path)) == 0, capsys.readouterr().err
    for bad_line in ['{"step": 1, "stage": ["rctp"]}', '{"step": "1"}', "[" * 100_000 + "]" * 100_000]:
        (tmp_path / "metrics.jsonl").write_text(bad_line + '\n{"step": 2, "loss": 1.0}\n')
        assert main(run_flags(tmp_path)) == 2
        err = capsys.readouterr().err
        assert "metrics.jsonl:1" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda d: None, "no metrics file"),
        (lambda d: (d / "metrics.jsonl").write_text(""), "no metric records"),
        (lambda d: (d / "metrics.jsonl").write_text('{"step": 1}\n{oops\n{"step": 2}\n'), "metrics.jsonl:2"),
        (lambda d: ((d / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n'),
                    (d / "eval.json").write_text("{")), "eval.json is not readable JSON"),
    ],
)
def test_clear_errors(tmp_path, capsys, setup, needle):
    setup(tmp_path)
    with pytest.raises(ReportError, match=needle):
        write_report(tmp_path)
    assert main(run_flags(tmp_path)) == 2
    assert needle.split(":")[0] in capsys.readouterr().err
    assert main(run_flags(tmp_path / "missing")) == 2
