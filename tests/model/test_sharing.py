"""Adapters and models another machine can use (rcgrpo.model.sharing, rcgrpo.model.hub).

The user's model here is a tiny random Llama saved with SmolLM2's own
tokenizer, the reward tokens taken out (as a hub model has it); it goes
through the real conversion (a copy with the tokens, in a fresh rcgrpo
cache), two LoRA stages exported by the trainer's own export (the second
started from the first's export, so its adapter is the composed one), and
then, with the rcgrpo cache deleted, the README's lines: transformers + peft
only, the base loaded by the id the adapter records. The Hub is a local fake
of its HTTP API (tests/fake_hub.py): the push uploads through huggingface_hub's
real client, and a hub id is then read back through snapshot_download.
"""
import dataclasses
import json
import shutil

import pytest
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD, LOW_REWARD, REWARD_TOKENS
from rcgrpo.config import ConfigError, parse_args
from rcgrpo.model.loading import load_tokenizer, resolve_model_folder, reward_token_ids
from rcgrpo.model.lora import ADAPTER_DIR
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.model.sharing import BASE_RECORD
from rcgrpo.pipeline.run import Run
from tests.fake_hub import FakeHub

LORA_ARGS = ["--model.lora.enabled", "true", "--model.lora.r", "4", "--model.lora.alpha", "8",
             "--model.lora.dropout", "0", "--model.lora.target_modules", "q_proj,v_proj,down_proj"]


def save_hub_model(folder, tokenizer, tied: bool):
    """A tiny random Llama with the tokenizer as the Hub has it: SmolLM2's,
    without the reward tokens (taken out of the token-extended one)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in REWARD_TOKENS]
    path.write_text(json.dumps(data))
    plain = AutoTokenizer.from_pretrained(str(folder))
    assert len(plain) == len(tokenizer) - 2 and plain.convert_tokens_to_ids(HIGH_REWARD) == plain.unk_token_id
    torch.manual_seed(0)
    # Narrow: the vocabulary's rows are most of what every save, push and fetch moves.
    config = LlamaConfig(vocab_size=len(plain), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def randomize(policy: TrainablePolicy, seed: int) -> None:
    """Trained-looking adapters: fresh ones (B = 0) would hide a wrong composition."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            if "trainable_tokens_delta" in name and p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    policy.equals_reference = False


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def two_stages(request, tmp_path_factory, tokenizer):
    """(run context, user's model id, the policies of both stages): each stage
    exported as the trainer exports it, in a run started from the user's
    folder, whose conversion went into a fresh rcgrpo cache (deleted after)."""
    root = tmp_path_factory.mktemp("share")
    mp = pytest.MonkeyPatch()
    mp.setenv("RCGRPO_CACHE", str(root / "rcgrpo-cache"))
    model_id = str(save_hub_model(root / "user-model", tokenizer, tied=request.param))
    cfg = parse_args(["--out-dir", str(root / "runs"), "--name", "share", "--run.report_to", "none",
                      "--model.name_or_path", model_id, *LORA_ARGS])
    base = resolve_model_folder(model_id)
    tok = load_tokenizer(base)
    ids = list(reward_token_ids(tok).values())
    ctx = Run(cfg, torch.device("cpu"), tok, base)
    policies, start = [], base
    for seed, stage in enumerate(("rctp", "rc-grpo")):
        policy = TrainablePolicy.load(start, cfg.model, torch.device("cpu"), reference=False, token_ids=ids)
        randomize(policy, seed)
        start = ctx.export_model(stage, policy, start=start)
        policies.append(policy)
    shutil.rmtree(root / "rcgrpo-cache")  # the other machine has none
    mp.undo()
    yield ctx, model_id, policies


def logits(model, tok) -> torch.Tensor:
    text = f"{HIGH_REWARD} List the files. {LOW_REWARD}"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


@pytest.mark.slow  # the two stages' setup: ~3 s per model variant
@pytest.mark.parametrize("stage", ["rctp", "rc-grpo"])
def test_a_stage_adapter_loads_onto_the_users_model_with_transformers_and_peft_alone(two_stages, stage, tmp_path):
    """The README's lines, on a copy of the adapter alone: the base by the
    recorded id (the user's, never a cache path), the recorded tokens with
    the same ids, then peft; the logits are the trained policy's (for
    rc-grpo: the composed adapter of both stages)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ctx, model_id, policies = two_stages
    adapter = shutil.copytree(ctx.stage_model_dir(stage) / ADAPTER_DIR, tmp_path / "adapter")
    record = json.loads((adapter / BASE_RECORD).read_text())
    assert PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path == model_id == record["base_model"]
    assert record["stages"] == (["rctp"] if stage == "rctp" else ["rctp", "rc-grpo"])

    # README.md, "Sharing a stage's model or adapter":
    tok = AutoTokenizer.from_pretrained(str(adapter))
    base = AutoModelForCausalLM.from_pretrained(model_id)
    base.resize_token_embeddings(max(len(tok), base.get_input_embeddings().num_embeddings), mean_resizing=False)
    model = PeftModel.from_pretrained(base, str(adapter))

    assert record["added_tokens"] == reward_token_ids(tok) == reward_token_ids(ctx.tokenizer)
    trained = policies[0 if stage == "rctp" else 1].model
    want, got = logits(trained, ctx.tokenizer), logits(model, tok)
    assert want.shape == got.shape
    diff = (got - want).abs().max().item()
    print(f"{stage}: max |logit difference| {diff:.2e}")
    assert diff < 1e-4, diff


@pytest.mark.slow  # saves and converts a model folder (~3.5 s)
def test_the_conversion_is_announced_with_its_size(tmp_path, tokenizer, monkeypatch, capsys):
    """The token-extended copy of a model without the tokens is the disk
    plan's item: said with its size before it is written, refused when the
    disk cannot hold it, and a folder that has the tokens is used in place."""
    from types import SimpleNamespace

    from rcgrpo.base.host import DiskPlanError

    monkeypatch.setenv("RCGRPO_CACHE", str(tmp_path / "cache"))
    user = save_hub_model(tmp_path / "m", tokenizer, tied=True)
    size = sum(p.stat().st_size for p in user.glob("*.safetensors"))
    half_free = SimpleNamespace(total=2 * size, used=size + size // 2, free=size // 2)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: half_free)  # a disk without room for the copy
    with pytest.raises(DiskPlanError, match=r"disk plan: the token-extended copy of .* GiB free; set RCGRPO_CACHE"):
        resolve_model_folder(str(user))
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("RCGRPO_CACHE", str(tmp_path / "cache"))
    capsys.readouterr()
    folder = resolve_model_folder(str(user))
    err = capsys.readouterr().err
    assert f"({size / 2**30:.2f} GiB) into {folder}" in err
    written = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert abs(written - size) < 0.01 * size  # the copy is the model, in its own dtype
    assert resolve_model_folder(str(folder)) == folder  # has the tokens: no second copy


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The fake Hub, a token, and a fresh Hugging Face cache."""
    import huggingface_hub.constants as hf

    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        yield hub


@pytest.mark.slow  # two stages up and down through the fake Hub: ~2 s per model variant
def test_push_uploads_each_stage_export_and_a_hub_id_reads_back_like_the_folder(two_stages, fake_hub, capsys):
    """run.push_to_hub: each stage's export, byte for byte, one commit per
    stage with the user's token, recorded so that it is not pushed twice;
    then the hub id (main: the last stage) resolves through snapshot_download
    to a folder with the same weights and the reward tokens, used in place,
    and eval takes it as a reward-token model."""
    from types import SimpleNamespace

    from rcgrpo.evaluation.settings import resolve_eval_settings
    from rcgrpo.model.hub import check_push
    from rcgrpo.model.loading import folder_weights
    from rcgrpo.train import push_finished_stage

    ctx, _, _ = two_stages
    cfg = parse_args(["--out-dir", str(ctx.run_dir.parent), "--name", ctx.cfg.run.name,
                      "--run.push_to_hub", "me/tool-caller", "--model.name_or_path", ctx.cfg.model.name_or_path,
                      *LORA_ARGS])
    check_push(cfg.run.push_to_hub)
    pushing = dataclasses.replace(ctx, cfg=cfg)  # the same run, asked to push
    for stage in ("rctp", "rc-grpo"):
        push_finished_stage(pushing, stage)
        local = ctx.stage_model_dir(stage)
        arrived = fake_hub.files("me/tool-caller")
        assert arrived == {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    push_finished_stage(pushing, "rc-grpo")  # already pushed: no third commit
    assert len(fake_hub.commits("me/tool-caller")) == 2
    writes = [r for r in fake_hub.requests if r[0] == "POST"]
    assert writes and all(auth == "Bearer hf_test_token" for _, _, auth in writes)
    assert "[rc-grpo] pushed to the Hub: me/tool-caller (this stage: me/tool-caller@" in capsys.readouterr().err

    folder = resolve_model_folder("me/tool-caller")
    assert "hf-cache" in str(folder) and (folder / ADAPTER_DIR / BASE_RECORD).is_file()
    pushed = dict(folder_weights(folder))
    assert all(torch.equal(t, pushed[k]) for k, t in folder_weights(ctx.stage_model_dir("rc-grpo")))
    assert resolve_eval_settings("me/tool-caller", SimpleNamespace()).conditioning == "high"
    first = resolve_model_folder(f"me/tool-caller@{fake_hub.commits('me/tool-caller')[0]}")
    assert json.loads((first / ADAPTER_DIR / BASE_RECORD).read_text())["stages"] == ["rctp"]


def test_push_without_a_token_is_one_line_before_training(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    from rcgrpo.model.hub import HubError
    from rcgrpo.train import run

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    cfg = parse_args(["--out-dir", str(tmp_path / "runs"), "--run.push_to_hub", "me/x"])
    with pytest.raises(HubError, match=r"^run.push_to_hub me/x: no Hugging Face token; set HF_TOKEN or run "):
        run(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value", ["me", "me/x@main", "./me/x", "me/x/y", "me/ x"])
def test_push_to_hub_must_be_a_repo_id(value):
    with pytest.raises(ConfigError, match=r"run.push_to_hub must be a Hub repo id owner/name, got"):
        parse_args(["--run.push_to_hub", value])


def test_a_hub_id_that_cannot_be_fetched_is_one_line(fake_hub):
    from rcgrpo.model.hub import HubError

    with pytest.raises(HubError, match=r"^cannot fetch me/missing from the Hub: "):
        resolve_model_folder("me/missing")
