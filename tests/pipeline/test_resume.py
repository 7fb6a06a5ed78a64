"""--resume continues a run only as it was configured: changes to what is
trained are refused with the list of differences, resume-safe ones are
allowed and recorded, and explicitly accepted ones are recorded as such."""
from __future__ import annotations

import json

import pytest

from rcgrpo import train as train_cli
from rcgrpo.base.errors import DEBUG_ENV
from rcgrpo.config import PRESETS, ConfigError, parse_args, save_config
from rcgrpo.pipeline.resume import CHANGES_FILE, ResumeError, check_resume


def started_run(tmp_path, *flags):
    """A run folder as a first invocation leaves it (its config saved)."""
    cfg = parse_args(["--out-dir", str(tmp_path), "--name", "r", "--grpo.batch_size", "4", "--grpo.lr", "1e-5",
                      *flags], check_files=False)
    save_config(cfg)
    return cfg.run_dir


def resumed(tmp_path, *flags):
    return parse_args(["--out-dir", str(tmp_path), "--name", "r", "--resume", "--grpo.batch_size", "4",
                       "--grpo.lr", "1e-5", *flags], check_files=False)


def changes(run_dir):
    path = run_dir / CHANGES_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_same_settings_resume_without_a_record(tmp_path):
    run_dir = started_run(tmp_path)
    assert check_resume(resumed(tmp_path)) == []
    assert changes(run_dir) == []


@pytest.mark.parametrize("flags, key", [
    (["--data.seed", "7"], "data.seed 0 -> 7"),
    (["--grpo.batch_size", "1"], "grpo.batch_size 4 -> 1"),
    (["--grpo.lr", "1e-2"], "grpo.lr 1e-05 -> 0.01"),
    (["--model.lora.enabled", "--model.lora.r", "4"], "model.lora.r 16 -> 4"),
    (["--pipeline", "sft+grpo"], "run.pipeline 'rctp+rc-grpo' -> 'sft+grpo'"),
    (["--grpo.loss_type", "dapo"], "grpo.loss_type 'grpo' -> 'dapo'"),
    (["--rctp.epochs", "3"], f"rctp.epochs {PRESETS['cpu-small']['rctp.epochs']} -> 3"),
    (["--data.categories", "base,miss_func"], "data.categories ['base'] -> ['base', 'miss_func']"),
])
def test_changes_to_what_is_trained_are_refused_and_listed(tmp_path, flags, key):
    run_dir = started_run(tmp_path)
    saved = (run_dir / "config.toml").read_text()
    with pytest.raises(ResumeError) as info:
        check_resume(resumed(tmp_path, *flags))
    message = str(info.value)
    assert key in message and "--run.accept_changes" in message and "--name" in message
    assert f"--config {run_dir / 'config.toml'}" in message
    assert changes(run_dir) == [] and (run_dir / "config.toml").read_text() == saved


def test_every_difference_is_listed_at_once(tmp_path):
    started_run(tmp_path)
    with pytest.raises(ResumeError) as info:
        check_resume(resumed(tmp_path, "--data.seed", "3", "--grpo.lr", "0.01", "--grpo.batch_size", "1"))
    assert "3 setting(s)" in str(info.value)
    assert "--run.accept_changes data.seed,grpo.lr,grpo.batch_size" in str(info.value)


def test_resume_safe_changes_are_allowed_and_recorded(tmp_path):
    run_dir = started_run(tmp_path)
    subset = str(PRESETS["cpu-small"]["eval.subset"] + 1)  # any value but the saved one
    cfg = resumed(tmp_path, "--run.checkpoint_every", "7", "--eval.subset", subset, "--run.report_to", "none",
                  "--device", "cpu", "--stages", "rctp,eval")
    got = {d.key for d in check_resume(cfg)}
    assert got == {"run.checkpoint_every", "eval.subset", "run.report_to", "run.device", "run.stages"}
    assert {r["key"]: r["how"] for r in changes(run_dir)} == dict.fromkeys(got, "resume-safe")
    row = next(r for r in changes(run_dir) if r["key"] == "run.checkpoint_every")
    assert (row["saved"], row["now"]) == (PRESETS["cpu-small"]["run.checkpoint_every"], 7)


def test_accepted_changes_go_through_and_are_recorded_as_accepted(tmp_path):
    run_dir = started_run(tmp_path)
    cfg = resumed(tmp_path, "--grpo.lr", "2e-5", "--grpo.steps", "9", "--run.accept_changes", "grpo.lr,grpo.steps")
    assert {d.key for d in check_resume(cfg)} == {"grpo.lr", "grpo.steps"}
    assert {(r["key"], r["saved"], r["now"], r["how"]) for r in changes(run_dir)} == {
        ("grpo.lr", 1e-5, 2e-5, "accepted"), ("grpo.steps", PRESETS["cpu-small"]["grpo.steps"], 9, "accepted")}
    # Accepting one change does not let another through.
    with pytest.raises(ResumeError, match="data.seed 0 -> 1"):
        check_resume(resumed(tmp_path, "--grpo.lr", "2e-5", "--data.seed", "1", "--run.accept_changes", "grpo.lr"))


def test_accepting_a_setting_that_does_not_exist_is_a_config_error():
    with pytest.raises(ConfigError, match=r"run.accept_changes: \['grpo.learning_rate'\] are not settings"):
        parse_args(["--run.accept_changes", "grpo.learning_rate"], check_files=False)


def test_a_run_that_does_not_exist_is_named_with_the_runs_that_do(tmp_path):
    started_run(tmp_path)
    with pytest.raises(ResumeError, match=r"no run 'other' in .* \(runs there: r\)"):
        check_resume(parse_args(["--out-dir", str(tmp_path), "--name", "other", "--resume"], check_files=False))
    with pytest.raises(ResumeError, match="there are no runs there"):
        check_resume(parse_args(["--out-dir", str(tmp_path / "empty"), "--resume"], check_files=False))


def test_a_corrupt_saved_config_is_named(tmp_path):
    run_dir = started_run(tmp_path)
    (run_dir / "config.json").write_text('{"grpo": {"lr": "fast"}}')
    with pytest.raises(ResumeError, match="config.json cannot be used: .*grpo.lr"):
        check_resume(resumed(tmp_path))


def test_the_command_line_refuses_in_one_line_and_keeps_the_saved_config(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    run_dir = started_run(tmp_path)
    saved = (run_dir / "config.json").read_text()
    argv = ["--out-dir", str(tmp_path), "--name", "r", "--resume", "--grpo.batch_size", "1", "--grpo.lr", "1e-5"]
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rcgrpo.train: ")]
    assert len(lines) == 1 and "grpo.batch_size 4 -> 1" in lines[0] and "Traceback" not in err
    assert (run_dir / "config.json").read_text() == saved


def test_a_refusal_names_the_preset_the_run_was_started_with(tmp_path):
    """A run started with --preset none (or with a model named, before the
    default preset applied to every model) is told which preset to add."""
    started_run(tmp_path, "--preset", "none")
    with pytest.raises(ResumeError, match=r"\(the run was started with preset none; this command line applies "
                                          r"cpu-small: add --preset none\)"):
        check_resume(resumed(tmp_path))
    assert check_resume(resumed(tmp_path, "--preset", "none")) == []
