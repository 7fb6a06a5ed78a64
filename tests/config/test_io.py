"""Config files in and out (rcgrpo/config/io.py): a TOML file's errors name the
setting, a saved config reads back equal, old keys of earlier runs' files
still read, a file that cannot be read is a ConfigError."""

from __future__ import annotations

import json

import pytest
import tomllib

from rcgrpo import config as C
from rcgrpo.config import ConfigError, config_from_dict, parse_args, save_config


@pytest.mark.parametrize(
    "toml, needle",
    [
        ("[grpo]\nlr = 'fast'\n", "grpo.lr (in "),
        ("[grpo]\nlr = true\n", "expected float, got bool"),
        ("[grpo]\ngroup_size = 5.0\n", "expected int, got float"),
        ("[gpro]\nlr = 1e-6\n", "did you mean 'grpo'"),
        ("[grpo]\nkl_coef = 0.1\n", "did you mean 'grpo.beta'"),
        ("[grpo\nlr = 1\n", "is not valid TOML"),
        ("[run]\nstages = 'rctp'\n", "expected list of str"),
        ("model = 3\n", "'model' is a section"),
        ("[model]\nlora = 'yes'\n", "'model.lora' is a section"),
    ],
)
def test_file_errors(tmp_path, toml, needle):
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(f)])
    assert needle in str(e.value)


def test_save_round_trip(tmp_path):
    cfg = parse_args(["--preset", "cpu-small", "--grpo.lr", "3.5e-7", "--run.stages", "rctp,rc-grpo",
                      "--eval.subset", "none", "--name", "rt"])
    path = save_config(cfg, tmp_path)
    assert path.name == "config.toml" and (tmp_path / "config.json").is_file()
    tomllib.loads(path.read_text())  # valid TOML
    again = C.load_config(path)
    assert again.to_dict() == cfg.to_dict()
    assert config_from_dict(json.loads((tmp_path / "config.json").read_text())).to_dict() == cfg.to_dict()


def test_the_renamed_advantage_setting_still_reads_saved_configs(tmp_path):
    """A run saved before advantage_scale became advantage_estimator resumes:
    its file's old key and values are read as the new ones; a flag with the
    old name is told the new one."""
    path = tmp_path / "old.toml"
    path.write_text('[grpo]\nadvantage_scale = "none"\n')
    assert parse_args(["--config", str(path)], check_files=False).grpo.advantage_estimator == "dr_grpo"
    path.write_text('[grpo]\nadvantage_scale = "group"\n')
    assert parse_args(["--config", str(path)], check_files=False).grpo.advantage_estimator == "grpo"
    with pytest.raises(ConfigError, match="now called 'grpo.advantage_estimator'"):
        parse_args(["--grpo.advantage_scale", "none"])
    assert parse_args(["--grpo.advantage_estimator", "rloo"]).grpo.advantage_estimator == "rloo"


def test_a_retired_setting_in_an_earlier_runs_file_is_skipped_and_a_flag_is_told_why(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[run]\nlog_every = 5\n")  # what runs saved before run.log_every went
    assert C.load_config(path).to_dict() == parse_args([]).to_dict()
    assert config_from_dict({"run": {"log_every": 5}}).to_dict() == parse_args(["--preset", "none"]).to_dict()
    with pytest.raises(ConfigError, match="'run.log_every' .* is no longer a setting: metric lines are written"):
        parse_args(["--run.log_every", "5"])


@pytest.mark.parametrize("content, says", [
    (b"[grpo]\nlr = 1e-6\n\xff\xfe\n", "is not UTF-8 text (byte 17: invalid start byte)"),
    (b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "is not valid TOML: nested too deeply to read"),
    (b"a = " + b"{b = " * 50_000 + b"1" + b"}" * 50_000 + b"\n", "is not valid TOML: nested too deeply to read"),
])
def test_a_config_file_not_utf8_or_nested_too_deeply_is_a_config_error(tmp_path, content, says):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)], check_files=False)
    assert f"config file {path} {says}" in str(info.value)
