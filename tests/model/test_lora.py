"""LoRA (peft) on the real SmolLM2 policy: config errors, the merged weight
stream, one trainer step that moves only the adapters with the fused and
reference paths agreeing, the adapters-off reference, export, and resume.

Short synthetic chats with the real tokenizer keep it fast: the subject is the
LoRA mechanics, not BFCL. Fresh adapters have B = 0 (they change nothing), so
the models here get a random B first: a wrong merge or a reference that
forgot to switch the adapters off then shows up as a numeric difference.
"""
import copy
import dataclasses
import importlib.util
import inspect
import shutil

import pytest
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD
from rcgrpo.config import ConfigError, LoraConfig, parse_args
from rcgrpo.model.loading import reward_token_ids
from rcgrpo.model.lora import ADAPTER_DIR, adapters_off, is_lora, unwrap, wrap
from rcgrpo.model.packing import pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.pipeline.run import Run
from rcgrpo.run.checkpoint import CheckpointError
from rcgrpo.training.finetune import finetune
from rcgrpo.training.losses import LOSS_PATHS, RLLossSettings, reference_logprobs, sft_loss, token_logprobs
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from rcgrpo.training.rl_update import UpdateSettings, rl_update
from tests.training.conftest import chat_record

TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA_ARGS = ["--model.lora.enabled", "true", "--model.lora.r", "4", "--model.lora.alpha", "8",
             "--model.lora.dropout", "0", "--model.lora.target_modules", ",".join(TARGETS)]


def lora_model(policy, seed=0):
    """A LoRA copy of the session policy (wrapping edits the model in place),
    as the TrainablePolicy a LoRA stage holds, with trainable reward-token rows."""
    ids = list(reward_token_ids(policy.tokenizer).values())
    model = wrap(copy.deepcopy(policy.model), LoraConfig(True, 4, 8.0, 0.0, list(TARGETS)), ids)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            if "trainable_tokens_delta" in name:  # moved rows: a merge that forgot them shows
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return TrainablePolicy(model, lora=True)


def make_ctx(tmp_path, tokenizer, policy, *extra):
    cfg = parse_args(["--out-dir", str(tmp_path), "--name", "lora", "--run.checkpoint_every", "0",
                      "--run.report_to", "none", "--grpo.beta", "0.1", *LORA_ARGS, *extra])
    return Run(cfg, torch.device("cpu"), tokenizer, policy.path)


@pytest.fixture(scope="module")
def trajectories(tokenizer):
    """One group with reward variance: non-zero advantages."""
    out = []
    for i, (reply, reward) in enumerate([("[ls(a=True)]", 1.0), ("[pwd()]", 0.0), ("[cd(folder='x')]", 1.0),
                                         ("I cannot help.", 0.0)]):
        rec = chat_record(tokenizer, f"List the files, request {i}.", reply,
                          HIGH_REWARD if reward else LOW_REWARD, reward)
        out.append(dataclasses.replace(rec.trajectory(), group=0, reward=reward))
    return out


def base_params(lp):
    return {n: p for n, p in lp.model.named_parameters() if not p.requires_grad}


def lora_params(lp):
    """What trains under LoRA: the adapters and the two reward-token rows."""
    return {n: p for n, p in lp.model.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("argv, needle", [
    (["--model.lora.r", "0"], "model.lora.r must be >= 1"),
    (["--model.lora.alpha", "0"], "model.lora.alpha must be > 0"),
    (["--model.lora.dropout", "1"], "model.lora.dropout must be in [0, 1)"),
    (["--model.lora.dropout", "-0.1"], "model.lora.dropout must be in [0, 1)"),
    (["--model.lora.target_modules", ""], "model.lora.target_modules must not be empty"),
])
def test_config_errors_name_the_setting(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(")", r"\)")):
        parse_args(["--model.lora.enabled", "true", *argv])


def test_enabled_without_peft_names_the_setting_and_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "peft" else real(n, *a))
    with pytest.raises(ConfigError) as e:
        parse_args(["--model.lora.enabled", "true"])
    assert "model.lora.enabled" in str(e.value) and "pip install peft==0.21.2" in str(e.value)
    assert not parse_args([]).model.lora.enabled  # disabled: peft not needed


def test_adapters_on_the_lm_head_are_refused(policy):
    with pytest.raises(ValueError, match="LM head"):
        wrap(copy.deepcopy(policy.model), LoraConfig(True, 4, 8.0, 0.0, ["q_proj", "lm_head"]))


# ------------------------------------------------------ merged weight stream


def test_rollout_weights_are_the_merged_plain_model_and_leave_the_model_unchanged(policy):
    lp = lora_model(policy)
    model = lp.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = lp.rollout_weights()
    assert inspect.isgenerator(stream)  # streamed, not a dict of everything
    pushed = dict(stream)

    merged = copy.deepcopy(model).merge_and_unload()
    expected = dict(merged.named_parameters())
    assert set(pushed) == set(expected)
    assert not any("base_model" in n or "base_layer" in n or "lora_" in n for n in pushed)
    for name, t in pushed.items():
        assert torch.equal(t, expected[name]), name
    # The merge is real: adapted layers differ from the base, others do not.
    plain = dict(policy.model.named_parameters())
    assert not torch.equal(pushed["model.layers.3.self_attn.q_proj.weight"], plain["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(pushed["model.layers.3.self_attn.k_proj.weight"], plain["model.layers.3.self_attn.k_proj.weight"])
    # The trained reward-token rows are in the pushed embedding, the rest of it is the base.
    ids = list(reward_token_ids(policy.tokenizer).values())
    emb, base_emb = pushed["model.embed_tokens.weight"], plain["model.embed_tokens.weight"]
    rows = dict(model.named_parameters())["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
    assert torch.equal(emb[ids], rows) and not torch.equal(emb[ids], base_emb[ids])
    others = torch.ones(emb.shape[0], dtype=torch.bool)
    others[ids] = False
    assert torch.equal(emb[others], base_emb[others])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the stream changed the model"
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged"))


# ----------------------------------------------------- one trainer step


def test_one_lora_rl_step_moves_only_adapters_and_fused_and_reference_paths_agree(
        policy, tokenizer, trajectories, tmp_path):
    lp = lora_model(policy)
    model = lp.model
    base_before = {n: p.detach().clone() for n, p in base_params(lp).items()}
    lora_before = {n: p.detach().clone() for n, p in lora_params(lp).items()}
    assert all("lora_" in n or "trainable_tokens_delta" in n for n in lora_before)
    assert all(p.dtype == torch.float32 for p in lora_params(lp).values())  # fp32 master weights

    # The reference is the base: adapters off equals the plain policy, and
    # differs from the adapted model (so switching them off matters).
    batch = pack(trajectories)
    with torch.no_grad():
        ref = reference_logprobs(lp, batch, LOSS_PATHS["fused"], temperature=1.0)
        plain = token_logprobs(TrainablePolicy(policy.model).lm, batch, LOSS_PATHS["fused"])
        adapted = token_logprobs(lp.lm, batch, LOSS_PATHS["fused"])
    torch.testing.assert_close(ref[batch.loss_mask], plain, atol=1e-5, rtol=1e-5)
    assert (adapted - ref[batch.loss_mask]).abs().max() > 1e-3

    settings = RLLossSettings(beta=0.1)
    results = {}
    for fused in (True, False):
        ctx = make_ctx(tmp_path / str(fused), tokenizer, policy, *(["--fused"] if fused else []))
        model.zero_grad(set_to_none=True)
        model.train()
        stats = rl_update(lp, trajectories, ctx.step_settings(), settings, UpdateSettings("group"))
        assert model.training, "the reference pass must leave the policy in training mode"
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[fused] = (stats, grads)
    (fs, fg), (ps, pg) = results[True], results[False]
    assert fs["kl"] > 0 and abs(fs["adv_abs_mean"]) > 0
    for key in ("loss", "kl", "entropy"):
        assert fs[key] == pytest.approx(ps[key], rel=1e-4, abs=1e-4), key
    assert set(fg) == set(pg) == set(lora_before), "only adapters get gradients"
    for name in fg:
        torch.testing.assert_close(fg[name], pg[name], atol=1e-5, rtol=1e-3)

    optimizer, scheduler = make_optimizer(lp, 1e-3, 0.0, 1, 0.0)
    assert clip_and_step(lp, optimizer, scheduler, 1.0) > 0
    assert all(torch.equal(p, base_before[n]) for n, p in base_params(lp).items())
    assert all(not torch.equal(p, lora_before[n]) for n, p in lora_params(lp).items() if "lora_A" in n)


def test_lora_sft_step_moves_only_adapters(policy, tokenizer, trajectories, tmp_path):
    ctx = make_ctx(tmp_path, tokenizer, policy, "--fused", "--sft.lr", "1e-3", "--sft.batch_size", "4",
                   "--sft.epochs", "1")
    lp = lora_model(policy)
    batch = pack(trajectories)
    with torch.no_grad():
        nll_fused, _ = sft_loss(lp.lm, batch, LOSS_PATHS["fused"])
        nll_plain, _ = sft_loss(lp.lm, batch, LOSS_PATHS["reference"])
    torch.testing.assert_close(nll_fused, nll_plain, atol=1e-4, rtol=1e-4)
    base_before = {n: p.detach().clone() for n, p in base_params(lp).items()}
    lora_before = {n: p.detach().clone() for n, p in lora_params(lp).items()}
    finetune(ctx, "sft", lp, trajectories, ctx.cfg.sft, ctx.step_settings())
    assert all(torch.equal(p, base_before[n]) for n, p in base_params(lp).items())
    moved = [n for n, p in lora_params(lp).items() if not torch.equal(p, lora_before[n])]
    assert len(moved) == len(lora_before)
    with torch.no_grad():
        assert sft_loss(lp.lm, batch, LOSS_PATHS["fused"])[0] < nll_fused


def test_one_lora_rctp_step_changes_both_reward_token_rows_and_the_export_holds_them(
        policy, tokenizer, trajectories, tmp_path):
    """Under LoRA the embeddings are frozen but the reward-token rows train:
    one RCTP step on tagged records (both tokens) moves both rows, and the
    merged export carries the moved rows (tests/model/test_lora_swap.py:
    the engine too)."""
    from safetensors.torch import load_file

    ctx = make_ctx(tmp_path, tokenizer, policy, "--fused", "--rctp.lr", "1e-2", "--rctp.batch_size", "4",
                   "--rctp.epochs", "1")
    lp = lora_model(policy)
    ids = list(reward_token_ids(tokenizer).values())
    rows = lambda: lora_params(lp)[  # noqa: E731
        "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"].detach().clone()
    before = rows()
    finetune(ctx, "rctp", lp, trajectories, ctx.cfg.rctp, ctx.step_settings())
    after = rows()
    assert all(not torch.equal(after[k], before[k]) for k in range(len(ids))), "a reward-token row did not train"
    folder = ctx.export_model("rctp", lp)
    exported = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    assert exported.dtype == torch.float32
    assert torch.equal(exported[ids], after)
    base = policy.model.get_input_embeddings().weight
    assert torch.equal(exported[:ids[0]], base[:ids[0]].detach())


def test_adapters_off_restores_adapters_and_mode(policy, trajectories):
    lp = lora_model(policy)
    model = lp.model
    batch = pack(trajectories)
    with torch.no_grad():
        on = token_logprobs(lp.lm, batch, LOSS_PATHS["fused"])
        model.train()
        with adapters_off(model):
            assert not model.training
        assert model.training
        torch.testing.assert_close(token_logprobs(lp.lm, batch, LOSS_PATHS["fused"]), on, atol=0, rtol=0)


# ------------------------------------------------------- export and resume


def test_export_is_the_merged_plain_model_plus_the_adapter(policy, tokenizer, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ctx = make_ctx(tmp_path, tokenizer, policy)
    lp = lora_model(policy)
    model = lp.model
    folder = ctx.export_model("rctp", lp)
    assert folder == ctx.stage_model_dir("rctp") and (folder / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    assert not is_lora(loaded)
    got = dict(loaded.named_parameters())
    expected = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    adapter = load_file(str(folder / ADAPTER_DIR / "adapter_model.safetensors"))
    assert (folder / ADAPTER_DIR / "adapter_config.json").is_file()
    assert len(adapter) == len(lora_params(lp))
    assert all(".lora_" in k or "trainable_tokens_delta" in k for k in adapter)


def test_resume_restores_adapters_optimizer_and_step(policy, tokenizer, trajectories, tmp_path):
    ctx = make_ctx(tmp_path, tokenizer, policy, "--fused")
    lp = lora_model(policy)
    optimizer, scheduler = make_optimizer(lp, 1e-3, 0.0, 4, 0.5)
    lp.train_mode()
    rl_update(lp, trajectories, ctx.step_settings(), RLLossSettings(beta=0.1), UpdateSettings("group"))
    clip_and_step(lp, optimizer, scheduler, 1.0)
    ctx.save("rc-grpo", 1, lp, optimizer, scheduler)
    ckpt = ctx.checkpoint_root("rc-grpo") / "ckpt-00000001" / "model"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()

    resumed_ctx = make_ctx(tmp_path, tokenizer, policy, "--fused", "--resume")
    other = lora_model(policy, seed=1)
    opt2, sched2 = make_optimizer(other, 1e-3, 0.0, 4, 0.5)
    assert resumed_ctx.resume("rc-grpo", other, opt2, sched2) == 1
    want, got = lora_params(lp), lora_params(other)
    assert all(torch.equal(got[n], want[n]) for n in want)
    s1, s2 = optimizer.state_dict(), opt2.state_dict()
    assert s1["state"].keys() == s2["state"].keys() and s2["state"]
    for k in s1["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])
    assert sched2.last_epoch == scheduler.last_epoch == 1

    # A LoRA checkpoint does not load into a full-weight run (and says why).
    with pytest.raises(CheckpointError, match="model.lora.enabled true"):
        resumed_ctx.resume("rc-grpo", TrainablePolicy(copy.deepcopy(policy.model)), None, None)


def test_gradient_checkpointing_keeps_adapter_gradients(policy, trajectories):
    """Frozen embeddings feed checkpointed blocks: without peft's input-grad
    hook the adapters inside would get no gradient."""
    batch = pack(trajectories)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same random A both times
        model = wrap(copy.deepcopy(policy.model), LoraConfig(True, 4, 8.0, 0.0, list(TARGETS)),
                     gradient_checkpointing=checkpointing)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01)
        lp = TrainablePolicy(model, lora=True)
        model.train()
        sft_loss(lp.lm, batch, LOSS_PATHS["fused"])[0].backward()
        grads.append({n: p.grad for n, p in lora_params(lp).items()})
    assert unwrap(model).is_gradient_checkpointing
    for name, g in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4)


@pytest.mark.slow  # the trainer's LoRA stage on the tiny model, run and resumed (~8 s on a busy 2-core machine)
def test_trainer_lora_stage_exports_merged_model_and_resumes_to_the_same_weights(tokenizer, tiny_folder, tmp_path,
                                                                                 capsys):
    """`python -m rcgrpo.train` with LoRA: the stage folder is the merged plain
    model (+ adapter/), checkpoints hold the adapter, and a run resumed from
    its step-1 checkpoint ends with exactly the uninterrupted run's weights.
    The stage's mechanics, not the model, are the subject: it trains the tiny
    Llama with the real tokenizer (tests/conftest.py, tiny_folder); the LoRA
    step on the 135M model is the tests above, and each run's tree parity
    check is tests/training/test_parity.py's subject."""
    from safetensors.torch import load_file

    from rcgrpo.data.rctp import save_records
    from rcgrpo.train import run

    records = [chat_record(tokenizer, f"List the files, request {i}.", "[ls(a=True)]", HIGH_REWARD, 1.0)
               for i in range(2)]
    data = save_records(records, tmp_path / "tiny.jsonl")
    argv = ["--fused", "--stages", "rctp", "--rctp.data_file", str(data), "--rctp.batch_size", "1",
            "--rctp.epochs", "1", "--rctp.lr", "1e-3", "--rctp.warmup_ratio", "0", "--run.checkpoint_every", "1",
            "--run.report_to", "none", "--out-dir", str(tmp_path / "runs"), "--name", "lora", *LORA_ARGS,
            "--model", str(tiny_folder),
            "--data.entry_ids", "multi_turn_base_1"]  # trained from the data file: spare tokenizing the split
    assert run(parse_args(argv)) == 0
    run_dir = tmp_path / "runs" / "lora"
    stage_dir = run_dir / "models" / "rctp"
    ckpt = run_dir / "checkpoints" / "rctp" / "ckpt-00000001" / "model"
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["adapter_model.safetensors"]
    assert (stage_dir / ADAPTER_DIR / "adapter_config.json").is_file()
    finished = load_file(str(stage_dir / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in finished and not any("lora" in k for k in finished)

    # Lose the finished stage; --resume continues from the step-1 checkpoint.
    (run_dir / "stages" / "rctp.done").unlink()
    shutil.rmtree(stage_dir)
    capsys.readouterr()
    assert run(parse_args(argv + ["--resume"])) == 0
    assert "resumed from" in capsys.readouterr().err  # not a fresh start that happens to match
    # Step 2 from the restored adapters, optimizer and scheduler state: Adam's
    # second step depends on its moments, so only a full restore matches.
    resumed = load_file(str(stage_dir / "model.safetensors"))
    assert resumed.keys() == finished.keys()
    assert all(torch.equal(resumed[k], finished[k]) for k in finished)
