"""The command line (rcgrpo/config/cli.py): layering (defaults <- preset <-
TOML <- CLI), the flags' forms, the help, and reading a config without the
model libraries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rcgrpo import config as C
from rcgrpo.config import parse_args


def test_layers_later_wins(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('preset = "cpu-small"\n[grpo]\nlr = 3e-6\nsteps = 7\n[model.lora]\nr = 4\n')
    cfg = parse_args(["--config", str(f), "--grpo.steps", "9", "--fused", "--name", "x"])
    assert cfg.preset == "cpu-small"
    assert cfg.data.entry_ids == C.PRESETS["cpu-small"]["data.entry_ids"]  # from the preset
    assert cfg.grpo.lr == 3e-6  # file over preset/defaults
    assert cfg.grpo.steps == 9  # CLI over file
    assert cfg.model.lora.r == 4
    assert cfg.run.fused and cfg.run.name == "x"
    # A CLI preset replaces the file's.
    assert parse_args(["--config", str(f), "--preset", "paper-qwen7b"], check_files=False).preset == "paper-qwen7b"


def test_cli_forms():
    cfg = parse_args(["--grpo.lr=2e-6", "--run.fused", "--run.report_to", "none", "--resume", "--data.train_subset",
                      "none", "--eval.categories", "base, miss_func", "--model.lora.dropout", "0"])
    assert cfg.grpo.lr == 2e-6 and cfg.run.fused and cfg.run.report_to is None and cfg.run.resume
    assert cfg.data.train_subset is None and cfg.eval.categories == ["base", "miss_func"]
    assert cfg.model.lora.dropout == 0.0
    assert not parse_args(["--fused", "false"]).run.fused
    assert not parse_args(["--no-fused"]).run.fused


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key in C.all_keys():
        assert f"--{key} " in out


@pytest.mark.slow  # what a fresh interpreter imports is the subject (~2.5 s)
def test_reading_a_config_loads_no_model_library():
    """Validating a config stays fast: a fresh interpreter, so nothing imported
    before counts. (torch comes with the loss types' registry in kernels.)"""
    code = ("import sys; from rcgrpo.config import parse_args; parse_args([]); "
            "assert not {'transformers', 'vllm', 'bfcl_eval'} & set(sys.modules), 'a model library imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
