"""MetricsLogger: one flushed JSON line per step, resume cuts, TensorBoard."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rcgrpo.run.metrics import MetricsLogger, progress, read_records
from tests.required import require


def lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir, stage=None):
    return [r["step"] for r in lines(run_dir) if r["stage"] == stage]


def test_each_line_is_flushed_and_values_converted(tmp_path):
    log = MetricsLogger(tmp_path, stage="rc-grpo")
    log.log(1, {"loss": torch.tensor(0.5), "stats": {"kl": np.float32(0.25)}}, reward_mean=1, ok=True)
    rec = lines(tmp_path)[0]  # readable before close: flushed
    assert rec["stage"] == "rc-grpo" and rec["step"] == 1 and isinstance(rec["time"], float)
    assert rec["loss"] == 0.5 and rec["stats/kl"] == 0.25 and rec["reward_mean"] == 1 and rec["ok"] is True
    log.log(2, loss=float("nan"))
    assert math.isnan(lines(tmp_path)[1]["loss"])
    with pytest.raises(ValueError, match="reserved"):
        log.log(3, {"time": 4})
    with pytest.raises(TypeError, match="scalar"):
        log.log(3, v=torch.ones(2))
    log.close()


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for s in range(1, 9):
            log.log(s, loss=s)
    with MetricsLogger(tmp_path, resume_step=5) as log:
        assert steps(tmp_path) == [1, 2, 3, 4, 5]
        log.log(6, loss=60)
    assert steps(tmp_path) == [1, 2, 3, 4, 5, 6] and lines(tmp_path)[-1]["loss"] == 60
    dropped = [json.loads(x)["step"] for x in (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()]
    assert dropped == [6, 7, 8]


def test_stages_share_the_file(tmp_path):
    with MetricsLogger(tmp_path, stage="rctp") as log:
        for s in (1, 2, 3):
            log.log(s, loss=s)
    with MetricsLogger(tmp_path, stage="rc-grpo") as log:  # next stage: appends
        for s in (1, 2, 3, 4):
            log.log(s, reward_mean=0.1 * s)
    with MetricsLogger(tmp_path, stage="rc-grpo", resume_step=2):
        assert steps(tmp_path, "rctp") == [1, 2, 3] and steps(tmp_path, "rc-grpo") == [1, 2]
    with MetricsLogger(tmp_path, stage="rctp"):  # stage redone from scratch
        assert lines(tmp_path) == []  # its old lines and all that followed them


def test_truncated_last_line_is_dropped_on_resume(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, loss=1)
        log.log(2, loss=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"stage": null, "step": 3, "lo')  # killed mid-write
    with pytest.warns(UserWarning, match="cut off"):
        MetricsLogger(tmp_path, resume_step=2).close()
    assert steps(tmp_path) == [1, 2]


def test_unreadable_lines_are_kept_in_the_dropped_file(tmp_path):
    with MetricsLogger(tmp_path, stage="rctp") as log:
        log.log(1, loss=1)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"stage": "rctp", "step": 2, "loss": 0.5} garbage after a crash\n')
        f.write('{"stage": "rctp", "step": 3, "loss": 0.2}\n')
        f.write('{"stage": "rctp", "step": 4, "lo')  # torn by a kill
    with pytest.warns(UserWarning, match="metrics.dropped.jsonl"):
        MetricsLogger(tmp_path, stage="rc-grpo").close()
    assert steps(tmp_path, "rctp") == [1, 3]
    kept = [json.loads(x) for x in (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()]
    assert kept == [{"unreadable_line": 2, "text": '{"stage": "rctp", "step": 2, "loss": 0.5} garbage after a crash'},
                    {"unreadable_line": 4, "text": '{"stage": "rctp", "step": 4, "lo'}]


def test_read_records_errors(tmp_path):
    from rcgrpo.run.metrics import MetricsFileError

    with pytest.raises(MetricsFileError, match="no metrics file"):
        read_records(tmp_path / "metrics.jsonl")
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2"):
        read_records(p)
    recs, problems = read_records(p, strict=False)
    assert [r["step"] for r in recs] == [1, 3] and len(problems) == 1


def test_tensorboard_scalars(tmp_path):
    require("tensorboard", "dev")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, stage="rc-grpo", report_to=["tensorboard"]) as log:
        for s in (1, 2, 3):
            log.log(s, reward_mean=0.5 * s, kl=float("nan") if s == 2 else 0.1, note="text is not a scalar")
    acc = EventAccumulator(str(tmp_path / "tb" / "rc-grpo"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward_mean")] == [0.5, 1.0, 1.5]
    assert [e.step for e in acc.Scalars("kl")] == [1, 3]  # a non-finite value is left out
    assert "note" not in acc.Tags()["scalars"]


def test_progress_conventions(monkeypatch, capsys):
    monkeypatch.setenv("RCGRPO_PROGRESS", "0")
    bar = progress(range(3), desc="rollout")
    assert bar.disable and list(bar) == [0, 1, 2]
    monkeypatch.setenv("RCGRPO_PROGRESS", "1")
    # stderr is not a terminal under pytest: a log file's conventions
    stage = progress(total=50, desc="rc-grpo")
    assert not stage.disable and stage.mininterval == 30.0
    inner = progress(total=50, desc="rollouts", leave=False)
    assert inner.disable  # an inner bar would print a line per update in a log
    assert progress(total=2, desc="rc-grpo", disable=True).disable
    for _ in range(50):
        inner.update(1)
        stage.update(1)
    inner.close()
    stage.close()
    err = capsys.readouterr().err
    assert "rollouts" not in err
    # the stage bar: its first and its closing draw only (50 updates inside 30 s)
    assert len([part for part in err.replace("\r", "\n").splitlines() if "rc-grpo" in part]) <= 3
