"""rcgrpo.model.shape and rcgrpo.training.memory_plan: parameter counts from shapes /
safetensors headers, and the per-rank memory plan that refuses a stage before any model
loads, naming the ways out (rcgrpo.training.memory_ways_out)."""

from __future__ import annotations

import json

import pytest

from rcgrpo.base.host import GiB
from rcgrpo.config import ConfigError, parse_args
from rcgrpo.model.shape import ModelShape, model_shape
from rcgrpo.rollout.vllm_engine import CPU_KV_CACHE_GIB
from rcgrpo.training.memory_plan import (
    ROLLOUT_BYTES_PER_TOKEN,
    MemoryPlanError,
    check_stage,
    plan_stage,
)

# Qwen/Qwen2.5-7B-Instruct's published config.json (the fields that matter)
QWEN7B = dict(
    model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
)
# The embedded SmolLM2-135M-Instruct (plus its two reward tokens)
SMOLLM2 = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, vocab_size=49154, tie_word_embeddings=True,
)
H200 = 141_000_000_000


def paper_cfg(*flags):
    return parse_args(["--preset", "paper-qwen7b", *flags], check_files=False)


def qwen_plan(cfg, world=1, stage="rc-grpo"):
    return plan_stage(ModelShape.from_config(QWEN7B), cfg, stage, world_size=world, local_world_size=world,
                      device_type="cuda", device_bytes=H200)


def test_qwen7b_parameter_count_matches_the_published_figure():
    shape = ModelShape.from_config(QWEN7B)
    assert shape.params == pytest.approx(7.61e9, rel=0.01)
    assert (shape.q_dim, shape.kv_dim) == (3584, 512)


def test_paper_preset_full_finetuning_on_one_h200_is_refused_with_ways_out():
    plan = qwen_plan(paper_cfg())
    assert not plan.fits
    with pytest.raises(MemoryPlanError) as err:
        check_stage(plan)
    msg = str(err.value)
    assert "\n" not in msg
    assert "rc-grpo" in msg and "GiB per rank" in msg and "131.3 GiB" in msg
    assert "--model.lora.enabled true (~" in msg
    assert "torchrun --nproc_per_node" in msg
    assert "AdamW state" in msg  # among the biggest items
    # checkpointing is already on: not offered
    assert "gradient_checkpointing" not in msg


def test_paper_preset_with_lora_on_one_h200_fits():
    cfg = paper_cfg()
    cfg.model.lora.enabled = True  # set directly: validating the flag needs peft installed
    plan = qwen_plan(cfg)
    assert plan.fits, plan.summary()
    check_stage(plan)
    assert "frozen base (bfloat16)" in plan.phases["update"]
    assert not any("reference" in k for k in plan.phases["update"])  # adapters off = the reference


def test_paper_preset_full_finetuning_over_eight_ranks_fits():
    plan = qwen_plan(paper_cfg(), world=8)
    assert plan.fits, plan.summary()
    check_stage(plan)
    assert plan.need_bytes < qwen_plan(paper_cfg()).need_bytes


def test_lora_is_single_process_only():
    cfg = paper_cfg()
    cfg.model.lora.enabled = True
    with pytest.raises(ValueError, match="single-process"):
        qwen_plan(cfg, world=2)


@pytest.mark.parametrize("family", ["llama-tied", "qwen2-untied"])
def test_from_folder_counts_exactly_and_from_config_agrees(tmp_path, family):
    import transformers
    if family == "llama-tied":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False,
        )
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    expected = sum(p.numel() for p in model.parameters())
    from_folder = ModelShape.from_folder(tmp_path)
    assert from_folder.params == expected
    assert from_folder.tied_embeddings is (family == "llama-tied")
    assert ModelShape.from_config(json.loads((tmp_path / "config.json").read_text())).params == expected


def test_cpu_default_fits_in_24_gb_and_moves_the_right_way():
    shape = ModelShape.from_config(SMOLLM2)
    assert shape.params == pytest.approx(134.5e6, rel=0.01)
    cfg = parse_args([], check_files=False)
    for stage in ("rctp", "sft", "rc-grpo", "grpo", "rctp-data", "eval"):
        plan = plan_stage(shape, cfg, stage, device_type="cpu", device_bytes=24_000_000_000)
        assert plan.fits, plan.summary()
        check_stage(plan)

    def need(c, **kw):
        kw.setdefault("device_type", "cpu")
        kw.setdefault("device_bytes", 24_000_000_000)
        return plan_stage(shape, c, "rc-grpo", **kw).need_bytes

    # On CPU the vLLM engine releases its KV cache while asleep (the update):
    # the update counts its weights only, the rollout phase both.
    rl = plan_stage(shape, cfg, "rc-grpo", device_type="cpu", device_bytes=24_000_000_000)
    assert rl.phases["update"]["engine (asleep: weights, no KV cache)"] == 4 * shape.params
    assert rl.phases["rollout"]["engine (awake)"] == 4 * shape.params + CPU_KV_CACHE_GIB * GiB
    ckpt = parse_args(["--model.gradient_checkpointing", "true"], check_files=False)
    assert need(ckpt) < need(cfg)
    fused = parse_args(["--fused"], check_files=False)
    assert need(fused) < need(cfg)
    one, two, eight = (need(cfg, device_type="cuda", device_bytes=H200, world_size=w, local_world_size=w)
                       for w in (1, 2, 8))
    assert eight < two < one


def test_rollouts_held_grow_with_batch_and_group():
    """A step holds batch x group rollouts of up to max_total_tokens tokens:
    before, the plan left them out, and --grpo.group_size 100000 passed."""
    shape = ModelShape.from_config(SMOLLM2)
    # A probe smaller than any step here (it is planned when larger: below).
    cfg = parse_args(["--grpo.batch_size", "8", "--grpo.group_size", "6", "--grpo.eval_rollouts", "4"],
                     check_files=False)
    plan = plan_stage(shape, cfg, "rc-grpo", device_type="cpu", device_bytes=24_000_000_000)
    label = "rollouts held (48: grpo.batch_size 8 x grpo.group_size 6; <= 4096 tokens each)"
    assert plan.phases["rollout"][label] == plan.phases["update"][label] == 48 * 4096 * ROLLOUT_BYTES_PER_TOKEN
    assert not any(k.startswith("rollouts") for k in
                   plan_stage(shape, cfg, "rctp", device_type="cpu", device_bytes=24_000_000_000).phases["update"])
    bigger = parse_args(["--grpo.batch_size", "8", "--grpo.group_size", "12"], check_files=False)
    grown = plan_stage(shape, bigger, "rc-grpo", device_type="cpu", device_bytes=24_000_000_000)
    assert grown.need_bytes > plan.need_bytes
    # Four engine groups each hold a quarter of the batch's prompts.
    split = plan_stage(shape, cfg, "rc-grpo", device_type="cpu", device_bytes=10**12, world_size=4,
                       local_world_size=4)
    assert "rollouts held (12: grpo.batch_size 8 x grpo.group_size 6 over the engine groups; <= 4096 tokens each)" \
        in split.phases["update"]


def test_the_sampled_reward_probe_counts_when_it_holds_more_rollouts_than_a_step():
    shape = ModelShape.from_config(SMOLLM2)
    args = ["--grpo.batch_size", "2", "--grpo.group_size", "2", "--grpo.eval_rollouts", "3000"]
    plan = plan_stage(shape, parse_args(args, check_files=False), "rc-grpo", device_type="cpu", device_bytes=10**12)
    label = "rollouts held (3000: grpo.eval_rollouts 3000, the sampled-reward probe; <= 4096 tokens each)"
    assert plan.phases["rollout"][label] == 3000 * 4096 * ROLLOUT_BYTES_PER_TOKEN
    off = parse_args(args + ["--grpo.eval_every", "0"], check_files=False)
    assert "rollouts held (4: grpo.batch_size 2 x grpo.group_size 2; <= 4096 tokens each)" in \
        plan_stage(shape, off, "rc-grpo", device_type="cpu", device_bytes=10**12).phases["rollout"]
    # On a host where the step fits but the probe does not, the probe is what is refused.
    check_stage(plan_stage(shape, off, "rc-grpo", device_type="cpu", device_bytes=19 * GiB))
    with pytest.raises(MemoryPlanError, match="grpo.eval_rollouts 3000"):
        check_stage(plan_stage(shape, parse_args(args, check_files=False), "rc-grpo", device_type="cpu",
                               device_bytes=19 * GiB))


def test_a_group_too_big_for_the_host_is_refused_naming_the_setting_and_a_size_that_fits():
    shape = ModelShape.from_config(SMOLLM2)
    cfg = parse_args(["--grpo.batch_size", "256", "--grpo.group_size", "1000"], check_files=False)
    with pytest.raises(MemoryPlanError) as err:
        check_stage(plan_stage(shape, cfg, "rc-grpo", device_type="cpu", device_bytes=24 * GiB))
    msg = str(err.value)
    assert "rollouts held (256000: grpo.batch_size 256 x grpo.group_size 1000; <= 4096 tokens each) 93.8 GiB" in msg
    assert "ways out: --grpo.group_size 31 (~" in msg and "--grpo.batch_size 8 (~" in msg
    fits = parse_args(["--grpo.batch_size", "256", "--grpo.group_size", "31"], check_files=False)
    check_stage(plan_stage(shape, fits, "rc-grpo", device_type="cpu", device_bytes=24 * GiB))


def test_rctp_data_holds_every_entrys_failure_attempts_at_once():
    shape = ModelShape.from_config(SMOLLM2)
    cfg = parse_args(["--rctp.failure_source", "rollouts", "--rctp.failure_attempts", "100000"], check_files=False)
    plan = plan_stage(shape, cfg, "rctp-data", device_type="cpu", device_bytes=24 * GiB, rctp_entries=2)
    label = "rollouts held (200000: 2 training entries x rctp.failure_attempts 100000; <= 4096 tokens each)"
    assert plan.phases["rollout"][label] == 200_000 * 4096 * ROLLOUT_BYTES_PER_TOKEN
    with pytest.raises(MemoryPlanError, match=r"ways out: --rctp.failure_attempts 25000 \(~"):
        check_stage(plan)
    # Unknown entries (0): the engine alone, as before.
    assert list(plan_stage(shape, cfg, "rctp-data", device_type="cpu", device_bytes=24 * GiB).phases["rollout"]) \
        == ["engine (awake)"]


def test_on_cuda_the_rollouts_must_fit_the_host():
    """The paper's batch and group (256 x 5 of up to 32k tokens, ~3.8 GiB)
    fit a 128 GiB host; 1000 per group does not, said in one line."""
    host = 128 * GiB
    plan = plan_stage(ModelShape.from_config(QWEN7B), paper_cfg(), "rc-grpo", world_size=8, local_world_size=8,
                      device_type="cuda", device_bytes=H200, host_bytes=host)
    assert plan.fits, plan.summary()
    assert 3 * GiB < sum(plan.host_items.values()) * 8 < 5 * GiB
    big = plan_stage(ModelShape.from_config(QWEN7B), paper_cfg("--grpo.group_size", "1000"), "rc-grpo",
                     world_size=8, local_world_size=8, device_type="cuda", device_bytes=H200, host_bytes=host)
    assert big.device_fits and not big.fits
    with pytest.raises(MemoryPlanError) as err:
        check_stage(big)
    msg = str(err.value)
    assert "\n" not in msg and "does not fit the host's memory" in msg
    assert "grpo.batch_size 256 x grpo.group_size 1000 over the engine groups" in msg
    assert "x 8 ranks on this host" in msg and "ways out: --grpo.group_size " in msg


def test_cpu_ranks_share_the_host():
    shape = ModelShape.from_config(QWEN7B)
    cfg = paper_cfg("--device", "cpu", "--model.dtype", "float32")
    alone = plan_stage(shape, cfg, "sft", device_type="cpu", device_bytes=1 << 40)
    four = plan_stage(shape, cfg, "sft", world_size=4, local_world_size=4, device_type="cpu", device_bytes=1 << 40)
    assert four.need_bytes < alone.need_bytes  # sharded per rank ...
    assert four.need_bytes * 4 > alone.need_bytes  # ... but the host holds all four
    assert four.available_bytes == (1 << 40) // 4
    with pytest.raises(MemoryPlanError) as err:
        check_stage(plan_stage(shape, cfg, "sft", device_type="cpu", device_bytes=24 * GiB))
    assert "host" in str(err.value) and "\n" not in str(err.value)


def test_ways_out_are_the_ones_that_help():
    # Activations dominate: a long micro-batch without checkpointing on a small GPU.
    shape = ModelShape.from_config(SMOLLM2)
    cfg = parse_args(["--preset", "none", "--model", "owner/m", "--run.micro_batch_tokens", "65536",
                      "--run.fused", "true"], check_files=False)
    plan = plan_stage(shape, cfg, "sft", device_type="cuda", device_bytes=24 * GiB, engine_alive=False)
    biggest = plan.biggest(1)[0][0]
    assert biggest.startswith("activations"), plan.summary()
    with pytest.raises(MemoryPlanError) as err:
        check_stage(plan)
    msg = str(err.value)
    fitting = msg.split("ways out: ")[1].split("not enough alone")[0]  # each of these fits on its own
    assert "--model.gradient_checkpointing true (~" in fitting
    assert "--run.micro_batch_tokens " in fitting
    assert "--fused" not in msg  # already on
    # the plan re-estimated with a listed way really fits
    cfg.model.gradient_checkpointing = True
    assert plan_stage(shape, cfg, "sft", device_type="cuda", device_bytes=24 * GiB, engine_alive=False).fits


def test_summary_is_a_readable_breakdown():
    text = qwen_plan(paper_cfg()).summary()
    assert "rollout phase" in text and "update phase" in text and "does NOT fit" in text
    assert "AdamW state (fp32)" in text and "margin" in text


def test_the_trainer_refuses_the_plan_before_any_weights_load(tmp_path, monkeypatch, capsys):
    """`python -m rcgrpo.train --preset paper-qwen7b` on one 141 GB GPU: a
    folder holding only Qwen2.5-7B's config.json (no weights to load) is
    enough to stop with exit code 2 and the ways out."""
    from rcgrpo.base import host
    from rcgrpo.train import main

    folder = tmp_path / "qwen7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN7B, "architectures": ["Qwen2ForCausalLM"]}))
    monkeypatch.setattr(host, "device_memory_bytes", lambda device: 141 * 10**9)
    code = main(["--preset", "paper-qwen7b", "--fused", "--model", str(folder), "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "memory plan: stage rctp does not fit" in err and "--model.lora.enabled true" in err
    assert not (tmp_path / "runs").exists()  # refused before the run folder was made


def test_a_way_out_is_a_checked_setting():
    """The ways out re-plan a copy of the config through
    rcgrpo.config.io.set_setting: a key that is no setting, or a value of the
    wrong type, is refused instead of set silently."""
    plan = qwen_plan(paper_cfg())
    assert plan.replan({"grpo.group_size": 2}).cfg.grpo.group_size == 2
    assert plan.cfg.grpo.group_size != 2  # a copy: the plan's own config is untouched
    with pytest.raises(ConfigError, match="grpo.group_sizes"):
        plan.replan({"grpo.group_sizes": 2})
    with pytest.raises(ConfigError, match="run.fused"):
        plan.replan({"run.fused": "yes"})


def test_model_shape_reads_a_folder_and_leaves_the_embedded_model_to_resolving(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert model_shape(str(tmp_path)) == ModelShape.from_config(SMOLLM2)
    assert model_shape("embedded:smollm2-135m-instruct") is None
    assert model_shape("embedded:smollm2-135m-instruct", resolved=tmp_path) == ModelShape.from_config(SMOLLM2)


@pytest.mark.parametrize("name, home", [("ModelShapeError", "rcgrpo.model.shape"),
                                        ("device_memory_bytes", "rcgrpo.base.host"),
                                        ("check_disk", "rcgrpo.base.host"), ("DiskPlanError", "rcgrpo.base.host")])
def test_names_that_moved_out_of_the_memory_plan_still_resolve_with_a_warning(name, home):
    import importlib

    from rcgrpo.training import memory_plan

    with pytest.warns(DeprecationWarning, match=f"moved to {home}.{name}"):
        old = getattr(memory_plan, name)
    assert old is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError):
        memory_plan.no_such_name  # noqa: B018
