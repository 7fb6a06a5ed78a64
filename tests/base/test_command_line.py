"""One command-line convention for rcgrpo-train, rcgrpo-eval and
rcgrpo-report (rcgrpo/base/command_line.py): the help tells the values a bare run
uses and what set them, a run's first lines say what it applies, the old
spellings still work with one deprecation line, each command has its
console script."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import tomllib

from rcgrpo import train as train_cli
from rcgrpo.base.command_line import CommandLineError
from rcgrpo.base.errors import DEBUG_ENV
from rcgrpo.config import PRESETS, load_config, parse_args
from rcgrpo.config import cli as config_cli
from rcgrpo.evaluation import cli as eval_cli
from rcgrpo.report import cli as report_cli

ROOT = Path(__file__).resolve().parents[2]


def test_each_command_has_its_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"rcgrpo-train", "rcgrpo-eval", "rcgrpo-report"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def help_of(argv, capsys, monkeypatch, columns=88):
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as info:
        parse_args([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_shows_a_bare_runs_values_and_the_preset_that_set_them(capsys, monkeypatch):
    out = help_of([], capsys, monkeypatch)
    steps = PRESETS["cpu-small"]["grpo.steps"]
    assert f"--grpo.steps INT  = {steps}  [preset cpu-small; --preset none: 400]" in out
    assert "--grpo.beta FLOAT  = 0.1\n" in out  # a default the preset leaves alone is not marked
    assert "--run.report_to LIST_OF_STR_OR_NONE  = tensorboard\n" in out
    assert "python -m rcgrpo.config" in out and "--print-config" in out
    titles = [line for line in out.splitlines() if re.fullmatch(r"[a-z][a-z.]*:", line)]
    assert titles[:2] == ["command:", "shortcuts:"]
    assert titles[2:] == ["model:", "model.lora:", "env:", "data:", "rctp:", "sft:", "grpo:", "eval:", "run:"]
    # Wrapped to the terminal: only a line of one unbreakable word may be longer.
    assert all(len(line) <= 88 or " " not in line.strip() for line in out.splitlines()[1:]), out
    # After other flags, the help shows what they give.
    assert "--grpo.steps INT  = 400\n" in help_of(["--preset", "none"], capsys, monkeypatch)
    assert "--grpo.steps INT  = 7  [flag]" in help_of(["--grpo.steps", "7"], capsys, monkeypatch)


def test_a_run_says_first_what_it_applies_whatever_the_model(tmp_path, capsys, monkeypatch):
    """`--model ./folder` keeps the default preset and says so in the run's
    first lines, before any work (here: a refused --resume)."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    model = tmp_path / "folder"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["--model", str(model), "--resume", "--name", "r", "--out-dir", str(tmp_path / "runs")]
    assert train_cli.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("preset cpu-small (the default, whatever --model names: a run sized for a 2-core CPU: 2 "
                        "training entries, 3 RL steps; --preset none runs the paper's sizes)")
    assert lines[1].startswith(f"model {model}; pipeline rctp+rc-grpo: rctp-data -> rctp -> rc-grpo -> eval")
    g = PRESETS["cpu-small"]
    assert f"rc-grpo {g['grpo.steps']} steps x {g['grpo.batch_size']} prompts x {g['grpo.group_size']} " \
        "rollouts" in lines[2]
    assert lines[3].startswith(f"settings not at their default: {len(g)} from preset cpu-small, 4 from flags; "
                               "all of them: python -m rcgrpo.config --model")
    assert lines[4].startswith("rcgrpo.train: error: --resume: there is no run 'r'") and len(lines) == 5
    bare = config_cli.run_header(config_cli.resolve([]))
    assert bare[0].startswith("preset cpu-small (the default: a run sized")
    paper = config_cli.run_header(config_cli.resolve(["--preset", "none"]))
    assert paper[0] == "no preset (--preset none): the defaults, the paper's numbers"
    assert "rc-grpo 400 steps x 256 prompts x 5 rollouts" in paper[2] and "720" in paper[2]


def test_print_config_writes_what_config_reads_back(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--print-config", "--grpo.lr", "2e-6", "--name", "x"])
    assert info.value.code == 0
    (tmp_path / "c.toml").write_text(capsys.readouterr().out)
    assert load_config(tmp_path / "c.toml").to_dict() == parse_args(["--grpo.lr", "2e-6", "--name", "x"]).to_dict()


def test_eval_takes_the_run_configs_keys_and_its_old_spellings(capsys):
    new = eval_cli.read_command_line(["--model", "m", "--eval.max_new_tokens=12", "--grpo.max_total_tokens", "900",
                                      "--data.doc_style", "compact", "--subset", "2", "--eval.conditioning", "auto"])
    assert capsys.readouterr().err == ""
    old = eval_cli.read_command_line(["--model", "m", "--max-new-tokens", "12", "--max-total-tokens=900",
                                      "--doc-style", "compact", "--eval.subset", "2"])
    assert vars(old) == vars(new)
    assert (new.max_new_tokens, new.max_total_tokens, new.doc_style, new.subset, new.conditioning) == \
        (12, 900, "compact", 2, None)  # auto: resolved from the model's run, as when not given
    assert capsys.readouterr().err.splitlines() == [
        "rcgrpo.eval: deprecated: --max-new-tokens still works, but write --eval.max_new_tokens",
        "rcgrpo.eval: deprecated: --max-total-tokens still works, but write --grpo.max_total_tokens",
        "rcgrpo.eval: deprecated: --doc-style still works, but write --data.doc_style"]
    with pytest.raises(CommandLineError, match="--eval.subset given twice"):
        eval_cli.read_command_line(["--model", "m", "--subset", "1", "--eval.subset", "2"])


def test_help_of_eval_and_report(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "70")
    assert eval_cli.main(["--help"]) == 0 and report_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rcgrpo-eval (--model PATH") and "usage: rcgrpo-report --name NAME" in out
    assert "--eval.max_new_tokens INT  = the run's, else 512" in out
    assert all(len(line) <= 70 for line in out.splitlines() if not line.startswith("usage:"))


def test_report_names_the_run_as_train_does_and_keeps_the_positional_folder(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("")
    assert report_cli.run_folder(["--name", "a", "--out-dir", str(tmp_path)]) == tmp_path / "a"
    assert report_cli.run_folder(["--run.name=b", "--run.out_dir", str(tmp_path)]) == tmp_path / "b"
    assert capsys.readouterr().err == ""
    assert report_cli.run_folder([str(tmp_path / "a")]) == tmp_path / "a"
    assert capsys.readouterr().err == (f"rcgrpo.report: deprecated: a positional run folder ({tmp_path / 'a'}) "
                                       f"still works, but write --name a --out-dir {tmp_path.as_posix()}\n")
    with pytest.raises(CommandLineError, match=r"which run\? give --name NAME \(runs with metrics there: a, b\)"):
        report_cli.run_folder(["--out-dir", str(tmp_path)])
    assert report_cli.main(["--name", "c", "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"rcgrpo.report: error: there is no run 'c' in {tmp_path} (runs with "
                                       "metrics there: a, b)\n")
