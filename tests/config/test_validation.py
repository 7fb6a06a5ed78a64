"""Config: layering (defaults <- preset <- TOML <- CLI), validation, round trip."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from rcgrpo import config as C
from rcgrpo.config import ConfigError, config_from_dict, parse_args, save_config
from rcgrpo.config.io import optional_inner


def test_defaults_are_the_papers_numbers():
    cfg = parse_args(["--preset", "none"])
    assert (cfg.rctp.lr, cfg.rctp.batch_size, cfg.rctp.epochs) == (1e-5, 16, 5)
    assert (cfg.sft.lr, cfg.sft.batch_size, cfg.sft.epochs) == (1e-5, 16, 2)
    g = cfg.grpo
    assert (g.lr, g.group_size, g.beta, g.eps_low, g.eps_high, g.p_high, g.steps) == (1e-6, 5, 0.1, 0.2, 0.2, 0.5, 400)
    assert g.batch_size == 256  # rc-grpo row of the paper's table
    assert parse_args(["--preset", "none", "--pipeline", "rctp+grpo"]).grpo.batch_size == 64
    assert cfg.run.pipeline == "rctp+rc-grpo" and cfg.run.out_dir == "runs" and not cfg.run.fused
    assert cfg.run.name == "rctp_rc-grpo" and str(cfg.run_dir) == "runs/rctp_rc-grpo"


def test_the_default_preset_applies_whatever_the_model(tmp_path):
    """Before, naming a model dropped the preset: a laptop's `--model ./folder`
    started 720 entries x 400 steps. The size changes only with --preset."""
    size = lambda cfg: (cfg.preset, cfg.grpo.steps, cfg.grpo.batch_size, cfg.data.entry_ids)
    bare = size(parse_args([]))
    assert bare[:2] == ("cpu-small", C.PRESETS["cpu-small"]["grpo.steps"])
    assert size(parse_args(["--model", "owner/name"], check_files=False)) == bare
    (tmp_path / "model.toml").write_text('[model]\nname_or_path = "owner/name"\n')
    assert size(parse_args(["--config", str(tmp_path / "model.toml")], check_files=False)) == bare
    assert parse_args(["--preset", "none", "--model", "owner/name"], check_files=False).grpo.batch_size == 256
    assert parse_args(["--preset", "none"]).preset is None


def test_pipeline_views():
    cfg = parse_args([])
    assert cfg.stages == ["rctp-data", "rctp", "rc-grpo", "eval"]
    assert (cfg.finetune_stage, cfg.rl_stage) == ("rctp", "rc-grpo")  # reward-conditioned rollouts
    assert cfg.eval.conditioning == "high"
    sg = parse_args(["--pipeline", "sft+grpo", "--stages", "eval,sft"])
    assert sg.stages == ["sft", "eval"]  # pipeline order, whatever the flag order
    assert (sg.finetune_stage, sg.rl_stage) == ("sft", "grpo")  # plain GRPO rollouts
    assert sg.eval.conditioning == "none"
    assert parse_args(["--pipeline", "sft+rc-grpo"]).eval.conditioning == "high"


def test_dynamic_sampling_pipeline():
    ds = parse_args(["--pipeline", "sft+grpo-ds"])
    assert ds.grpo.dynamic_sampling is True and ds.rl_stage == "grpo" and ds.stages == ["sft", "grpo", "eval"]
    assert ds.eval.conditioning == "none" and ds.run.name == "sft_grpo-ds"
    assert parse_args([]).grpo.dynamic_sampling is False
    assert parse_args(["--grpo.dynamic_sampling", "true"]).grpo.dynamic_sampling is True


def test_dynamic_sampling_is_single_process(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="grpo.dynamic_sampling is single-process only"):
        parse_args(["--pipeline", "sft+grpo-ds"])


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


def test_model_folder_checked(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        parse_args(["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text("{}")
    assert parse_args(["--model", str(tmp_path)]).model.name_or_path == str(tmp_path)
    assert parse_args(["--model", "Qwen/Qwen2.5-7B-Instruct"]).model.name_or_path  # a hub id is not a path


def test_save_round_trip(tmp_path):
    cfg = parse_args(["--preset", "cpu-small", "--grpo.lr", "3.5e-7", "--run.stages", "rctp,rc-grpo",
                      "--eval.subset", "none", "--name", "rt"])
    path = save_config(cfg, tmp_path)
    assert path.name == "config.toml" and (tmp_path / "config.json").is_file()
    tomllib.loads(path.read_text())  # valid TOML
    again = C.load_config(path)
    assert again.to_dict() == cfg.to_dict()
    assert config_from_dict(json.loads((tmp_path / "config.json").read_text())).to_dict() == cfg.to_dict()


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for key in C.all_keys():
        assert f"--{key} " in out


def test_constants_match_the_modules_they_mirror():
    from rcgrpo.model import loading as models

    assert C.EMBEDDED_MODEL == models.EMBEDDED


def test_loss_type_choices_are_the_kernels_registry():
    import rcgrpo_kernels

    assert C.LOSS_TYPES == tuple(rcgrpo_kernels.LOSS_TYPES)
    with pytest.raises(ConfigError, match=r"grpo.loss_type must be one of \('grpo', 'bnpo', .*\), got 'gspo'"):
        parse_args(["--grpo.loss_type", "gspo"])
    assert C.ADVANTAGE_ESTIMATORS == tuple(rcgrpo_kernels.ADVANTAGE_ESTIMATORS)
    assert C.KL_ESTIMATORS == tuple(rcgrpo_kernels.KL_ESTIMATORS)
    with pytest.raises(ConfigError, match=r"grpo.kl_estimator must be one of \('k3', .*\), got 'k4'"):
        parse_args(["--grpo.kl_estimator", "k4"])
    with pytest.raises(ConfigError, match=r"grpo.clip_ratio_c must be > 1"):
        parse_args(["--grpo.clip_ratio_c", "0.5"])


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


def test_every_preset_is_valid():
    for name in C.PRESETS:
        cfg = parse_args(["--preset", name], check_files=False)
        assert cfg.preset == name


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


def test_resume_safe_keys_are_real_settings():
    keys = set(C.all_keys())
    assert C.resume_safe_keys() - {"preset"} <= keys
    # What decides what is trained is never resume-safe.
    for key in ("model.name_or_path", "data.seed", "grpo.lr", "grpo.batch_size", "rctp.epochs", "run.pipeline",
                "grpo.loss_type", "model.lora.r", "data.categories", "grpo.group_size", "grpo.steps"):
        assert key not in C.resume_safe_keys()


def test_a_retired_setting_in_an_earlier_runs_file_is_skipped_and_a_flag_is_told_why(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[run]\nlog_every = 5\n")  # what runs saved before run.log_every went
    assert C.load_config(path).to_dict() == parse_args([]).to_dict()
    assert config_from_dict({"run": {"log_every": 5}}).to_dict() == parse_args(["--preset", "none"]).to_dict()
    with pytest.raises(ConfigError, match="'run.log_every' .* is no longer a setting: metric lines are written"):
        parse_args(["--run.log_every", "5"])


def test_presets_are_data_in_dotted_keys():
    for name, values in C.PRESETS.items():
        assert set(values) <= set(C.all_keys()), name


def test_reading_a_config_loads_no_model_library():
    """Validating a config stays fast: a fresh interpreter, so nothing imported
    before counts. (torch comes with the loss types' registry in kernels.)"""
    code = ("import sys; from rcgrpo.config import parse_args; parse_args([]); "
            "assert not {'transformers', 'vllm', 'bfcl_eval'} & set(sys.modules), 'a model library imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


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
