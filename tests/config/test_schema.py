"""The schema (rcgrpo/config/schema.py): the paper's defaults, the pipeline's
views, the choice lists that mirror other modules, which keys are resume-
safe."""

from __future__ import annotations

import pytest

from rcgrpo import config as C
from rcgrpo.config import ConfigError, parse_args


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


def test_resume_safe_keys_are_real_settings():
    keys = set(C.all_keys())
    assert C.resume_safe_keys() - {"preset"} <= keys
    # What decides what is trained is never resume-safe.
    for key in ("model.name_or_path", "data.seed", "grpo.lr", "grpo.batch_size", "rctp.epochs", "run.pipeline",
                "grpo.loss_type", "model.lora.r", "data.categories", "grpo.group_size", "grpo.steps"):
        assert key not in C.resume_safe_keys()
