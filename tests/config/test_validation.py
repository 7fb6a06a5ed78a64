"""Validation (rcgrpo/config/validation.py): every limit and rule names the
setting, all problems at once, non-finite numbers, seeds, empty text and
empty list items refused from a flag and from a file alike.

The rest of the config package: test_schema.py, test_presets.py, test_io.py,
test_cli.py."""

from __future__ import annotations

import importlib.util

import pytest

from rcgrpo import config as C
from rcgrpo.config import ConfigError, parse_args
from rcgrpo.config.io import optional_inner


def test_dynamic_sampling_is_single_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling is single-process only"):
        parse_args(["--pipeline", "sft+grpo-ds"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--grpo.lrr", "1"], "did you mean 'grpo.lr'"),
        (["--grpo.G", "3"], "did you mean 'grpo.group_size'"),
        (["--lr", "1"], "'rctp.lr' or 'sft.lr' or 'grpo.lr'"),
        (["--fuse"], "did you mean 'fused'"),
        (["--grpo.lr", "fast"], "grpo.lr: expected float, got 'fast'"),
        (["--grpo.group_size", "2.5"], "grpo.group_size: expected int"),
        (["--run.fused", "maybe"], "run.fused: expected bool"),
        (["--grpo.lr"], "--grpo.lr needs a value"),
        (["--grpo.lr", "0"], "grpo.lr must be > 0"),
        (["--rctp.lr", "-1e-5"], "rctp.lr must be > 0"),
        (["--grpo.group_size", "1"], "grpo.group_size must be in [2, 1024]"),
        (["--grpo.p_high", "1.5"], "grpo.p_high must be in [0, 1]"),
        (["--grpo.eps_low", "-0.1"], "grpo.eps_low must be in [0, 1)"),
        (["--grpo.eps_high", "-0.1"], "grpo.eps_high must be >= 0"),
        (["--grpo.beta", "-1"], "grpo.beta must be >= 0"),
        (["--grpo.loss_type", "ppo"], "grpo.loss_type must be one of"),
        (["--grpo.temperature", "0"], "grpo.temperature must be > 0"),
        (["--pipeline", "rctp+ppo"], "run.pipeline must be one of ('rctp+rc-grpo', "),
        (["--pipeline", "rctp+ppo"], "got 'rctp+ppo'; did you mean 'rctp+grpo'"),
        (["--grpo.loss_type", "dapoo"], "did you mean 'dapo'"),
        (["--stages", "sft"], "not in pipeline rctp+rc-grpo"),
        (["--data.categories", "base,web"], "unknown categories ['web']"),
        (["--name", "a/b"], "run.name must be a plain folder name"),
        (["--model.dtype", "fp8"], "model.dtype must be one of"),
        (["--model", "./no/such/folder"], "model folder ./no/such/folder does not exist"),
        (["--model", "embedded:gpt5"], "unknown embedded model"),
        (["--config", "/no/such.toml"], "config file /no/such.toml does not exist"),
        (["--rctp.data_file", "/no/such.jsonl"], "rctp.data_file: /no/such.jsonl does not exist"),
        (["--preset", "gpu-huge"], "unknown preset 'gpu-huge' (--preset); the presets are cpu-small, paper-qwen7b"),
        (["positional"], "unexpected argument 'positional'"),
        (["--model.lora.dropout", "1"], "model.lora.dropout must be in [0, 1)"),
        (["--data.max_prompt_tokens", "9000"], "must exceed data.max_prompt_tokens"),
        (["--data.entry_ids", "multi_turn_base_1,multi_turn_base_1"], "data.entry_ids has duplicates"),
        (["--sft.epochs", "0"], "sft.epochs must be >= 1 (use --stages to skip a stage), got 0"),
        (["--eval.split", "dev"], "eval.split must be one of ('test', 'train'), got 'dev'"),
        (["--stages", "rctp,rctp"], "run.stages has duplicates: ['rctp', 'rctp']"),
        (["--run.engine_memory_fraction", "1"], "run.engine_memory_fraction must be in (0, 1), got 1.0"),
        (["--grpo.top_p", "0"], "grpo.top_p must be in (0, 1], got 0.0"),
        (["--grpo.tis_cap", "0"], "grpo.tis_cap must be > 0 (none = off)"),
        (["--grpo.mini_batches", "0"], "grpo.mini_batches must be >= 1"),
        (["--grpo.batch_size", "2", "--grpo.mini_batches", "3"], "must not exceed grpo.batch_size (2)"),
        (["--grpo.dynamic_sampling_max_draws", "0"], "grpo.dynamic_sampling_max_draws must be >= 1"),
        (["--pipeline", "sft+grpo-ds", "--grpo.dynamic_sampling", "false"],
         "grpo.dynamic_sampling false contradicts the pipeline sft+grpo-ds"),
    ],
)
def test_errors_name_the_setting(argv, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert needle in str(e.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        parse_args(["--grpo.lr", "0", "--sft.epochs", "0", "--grpo.p_high", "-1"])
    assert len(e.value.problems) == 3 and "3 problems" in str(e.value)


def test_lora_needs_peft(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "peft" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install peft"):
        parse_args(["--model.lora.enabled"])
    parse_args(["--model.lora.r", "8"])  # disabled: options validated, peft not needed


def test_model_folder_checked(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        parse_args(["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text("{}")
    assert parse_args(["--model", str(tmp_path)]).model.name_or_path == str(tmp_path)
    assert parse_args(["--model", "Qwen/Qwen2.5-7B-Instruct"]).model.name_or_path  # a hub id is not a path


FLOAT_KEYS = [k for k, (tp, _) in C.all_keys().items() if tp is float or optional_inner(tp) is float]


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400"])
def test_every_float_setting_rejects_non_finite(key, text):
    with pytest.raises(ConfigError) as info:
        parse_args([f"--{key}", text], check_files=False)
    assert info.value.problems == [f"{key} must be a finite number, got {float(text)}"]


def test_non_finite_floats_from_a_file_too(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[grpo]\nlr = inf\neps_high = nan\n")
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)], check_files=False)
    assert sorted(info.value.problems) == ["grpo.eps_high must be a finite number, got nan",
                                           "grpo.lr must be a finite number, got inf"]


@pytest.mark.parametrize("seed", [-1, 2**32, 10**30])
def test_seed_outside_numpys_range_is_refused(seed):
    with pytest.raises(ConfigError, match=r"data.seed must be in \[0, 4294967295\]"):
        parse_args(["--data.seed", str(seed)], check_files=False)


def test_seed_bounds_are_accepted_and_usable():
    import numpy as np

    for seed in (0, C.SEED_MAX):
        np.random.seed(parse_args(["--data.seed", str(seed)], check_files=False).data.seed)


TEXT_KEYS = [k for k, (tp, _) in C.all_keys().items() if str in (tp, optional_inner(tp))]
LIST_KEYS = [k for k, (tp, _) in C.all_keys().items() if "list[str]" in str(tp)]  # lists of text


@pytest.mark.parametrize("key", TEXT_KEYS)
def test_every_text_setting_refuses_an_empty_string(key):
    """"" is a mistake (an unset shell variable), never the default: from a
    flag and from a file alike."""
    with pytest.raises(ConfigError) as info:
        parse_args([f"--{key}", ""], check_files=False)
    if key == "preset":  # a preset is looked up as the command line is read
        assert str(info.value).startswith("unknown preset ''")
    else:
        assert f"{key} must not be an empty string (leave the setting out for its default)" in info.value.problems


@pytest.mark.parametrize("key", LIST_KEYS)
def test_every_list_setting_refuses_an_empty_item(key, tmp_path):
    with pytest.raises(ConfigError, match=f"{key} has an empty item"):
        parse_args([f"--{key}", "a,,b"], check_files=False)
    section, name = key.rsplit(".", 1)
    path = tmp_path / "c.toml"
    path.write_text(f'[{section}]\n{name} = ["a", " "]\n')
    with pytest.raises(ConfigError, match=f"{key} has an empty item"):
        parse_args(["--config", str(path)], check_files=False)


def test_empty_text_in_a_file_is_refused_too(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = ""\nout_dir = " "\n')
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)], check_files=False)
    assert sorted(info.value.problems) == [
        "run.name must not be an empty string (leave the setting out for its default)",
        "run.out_dir must not be an empty string (leave the setting out for its default)",
    ]


def test_the_papers_group_and_batch_are_inside_the_bounds():
    cfg = parse_args(["--preset", "none"], check_files=False)
    assert (cfg.grpo.group_size, cfg.grpo.batch_size) == (5, 256)
    parse_args(["--grpo.group_size", "1024", "--grpo.batch_size", "16384"], check_files=False)
    with pytest.raises(ConfigError, match=r"grpo.group_size must be in \[2, 1024\]"):
        parse_args(["--grpo.group_size", "1025"], check_files=False)
