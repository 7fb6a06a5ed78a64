"""Training in the precision users will use moves the weights.

With `model.dtype bfloat16` the policy keeps fp32 master weights (and fp32
AdamW moments) and runs its matmuls in bf16. At the RL learning rate (1e-6)
an AdamW step is far below bf16's resolution of a typical weight (~2^-8 of
it), so the old pure-bf16 update, rebuilt here, rounds almost every step away;
the mixed one must deliver nearly the fp32 update.

To keep the suite's time (bf16 matmuls are slow on this CPU: a step of the
whole model costs seconds), the model is the 135M model's own weights cut to
its last decoder layer (embedding and tied head, final norm included):
the effect is per weight, and these are the real weights and magnitudes.
"""
import pytest
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD
from rcgrpo.config import parse_args
from rcgrpo.model.packing import pack
from rcgrpo.model.policy import PackedLM, TrainablePolicy
from rcgrpo.training.losses import LOSS_PATHS, sft_loss
from rcgrpo.training.optimizer import clip_and_step, make_optimizer
from tests.training.conftest import chat_record

STEPS, LR = 50, 1e-6
KEPT_LAYERS = 1


def keep_the_last_layers(model) -> None:
    """In place: the decoder keeps only its last KEPT_LAYERS layers."""
    model.model.layers = model.model.layers[-KEPT_LAYERS:]
    model.config.num_hidden_layers = KEPT_LAYERS


@pytest.fixture(scope="module")
def trajectories(tokenizer):
    records = [chat_record(tokenizer, "List the files.", "[ls(a=True)]", HIGH_REWARD, 1.0),
               chat_record(tokenizer, "Go to the folder temp.", "[cd(folder='temp')]", HIGH_REWARD, 0.0)]
    return [r.trajectory() for r in records]


@pytest.fixture(scope="module")
def batch(trajectories):
    return pack(trajectories)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def update_norm(start: dict, model) -> float:
    """||W_end - W_start|| over every weight, in fp32."""
    end = weights(model)
    return float(torch.sqrt(sum(((end[n] - start[n]) ** 2).sum() for n in start)))


def train_policy(model_dir, batch, dtype: str) -> tuple[float, TrainablePolicy, torch.optim.Optimizer]:
    cfg = parse_args(["--model.dtype", dtype], check_files=False)
    policy = TrainablePolicy.load(model_dir, cfg.model, torch.device("cpu"), reference=False)
    keep_the_last_layers(policy.model)
    start = weights(policy.model)
    optimizer, scheduler = make_optimizer(policy, LR, 0.0, STEPS, 0.0)
    policy.train_mode()
    for _ in range(STEPS):
        sft_loss(policy.lm, batch, LOSS_PATHS["fused"])[0].backward()
        clip_and_step(policy, optimizer, scheduler, 0.0)
    return update_norm(start, policy.model), policy, optimizer


def train_pure_bf16(model_dir, batch) -> float:
    """The old trainer: weights loaded in bf16 and stepped in place by AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    keep_the_last_layers(model)
    lm = PackedLM(model.model, model.config, lambda: model.lm_head.weight, torch.bfloat16, None)
    start = weights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    for _ in range(STEPS):
        sft_loss(lm, batch, LOSS_PATHS["fused"])[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return update_norm(start, model)


@pytest.mark.slow  # 50 AdamW steps of the 135M model in three precisions (~17 s)
def test_bf16_compute_keeps_the_fp32_update_and_pure_bf16_loses_it(model_dir, batch):
    fp32, _, _ = train_policy(model_dir, batch, "float32")
    mixed, policy, optimizer = train_policy(model_dir, batch, "bfloat16")
    pure = train_pure_bf16(model_dir, batch)
    print(f"\n{STEPS} AdamW steps at lr {LR}: |dW| fp32 {fp32:.4g}, bf16 compute + fp32 master {mixed:.4g} "
          f"({mixed / fp32:.1%}), pure bf16 {pure:.4g} ({pure / fp32:.1%})")
    # Every master weight, gradient accumulator and AdamW moment is fp32.
    assert sum(p.numel() for p in policy.trainable_parameters()) > 30_000_000  # the embedding (tied head) and one layer
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    assert {v.dtype for st in optimizer.state.values() for k, v in st.items() if k != "step"} == {torch.float32}
    assert mixed >= 0.9 * fp32
    assert pure < 0.2 * fp32


@pytest.mark.slow  # loads the 135M model (policy and reference)
def test_bf16_compute_runs_the_decoder_and_head_in_bf16_from_fp32_masters(model_dir, batch):
    cfg = parse_args(["--model.dtype", "bfloat16"], check_files=False)
    policy = TrainablePolicy.load(model_dir, cfg.model, torch.device("cpu"), reference=True)
    keep_the_last_layers(policy.model)
    assert next(policy.model.parameters()).dtype == torch.float32
    assert policy.lm.hidden_states(batch).dtype == torch.bfloat16
    # On CPU the chunked kernels compute the head in fp32: the master weight as is.
    assert policy.lm.lm_head_weight().dtype == torch.float32
    # The frozen reference holds what autocast computes with: the decoder's
    # Linear weights in bf16, the embedding (the tied head here) in fp32.
    with policy.reference() as ref:
        assert ref.lm_head_weight().dtype == torch.float32
        assert ref.hidden_states(batch).dtype == torch.bfloat16
    policy.train_mode()
    sft_loss(policy.lm, batch, LOSS_PATHS["fused"])[0].backward()
    grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
    assert len(grads) >= 10 and all(g.dtype == torch.float32 for g in grads)


def test_under_bf16_autocast_the_reference_computes_exactly_like_the_policy_at_step_0(tmp_path, tokenizer,
                                                                                     tiny_folder, trajectories):
    """KL is 0 before the first update, not rounding noise: the policy runs
    fp32 masters under bf16 autocast, and its reference computes the same
    numbers (a copy held all in bf16 does not: its embeddings, norms and
    residual stream round)."""
    from transformers import AutoModelForCausalLM

    from rcgrpo.pipeline.run import Run
    from rcgrpo.training.losses import RLLossSettings, reference_logprobs, token_logprobs
    from rcgrpo.training.rl_update import UpdateSettings, rl_update

    cfg = parse_args(["--model.dtype", "bfloat16", "--fused", "--out-dir", str(tmp_path), "--run.report_to",
                      "none"], check_files=False)
    policy = TrainablePolicy.load(tiny_folder, cfg.model, torch.device("cpu"), reference=True)
    batch = pack(trajectories)
    with torch.no_grad():
        own = token_logprobs(policy.lm, batch, LOSS_PATHS["fused"]).float()
    ref = reference_logprobs(policy, batch, LOSS_PATHS["fused"], temperature=1.0)[batch.loss_mask]
    assert torch.equal(own, ref)
    all_bf16 = AutoModelForCausalLM.from_pretrained(str(tiny_folder), dtype=torch.bfloat16)
    lm = PackedLM(all_bf16.model, all_bf16.config, lambda: all_bf16.lm_head.weight, torch.bfloat16, "cpu")
    with torch.no_grad():
        assert not torch.equal(token_logprobs(lm, batch, LOSS_PATHS["fused"]).float(), ref)
    # Step 1 of an RL stage (rewards 1 and 0: a non-zero advantage) reports KL exactly 0.
    ctx = Run(cfg, torch.device("cpu"), tokenizer, tiny_folder)
    optimizer, scheduler = make_optimizer(policy, 1e-3, 0.0, 1, 0.0)
    stats = rl_update(policy, trajectories, ctx.step_settings(), RLLossSettings(beta=0.1), UpdateSettings(), optimizer=optimizer,
                      scheduler=scheduler)
    assert stats["updates"] == 1 and stats["kl"] == 0.0


def test_float16_compute_is_refused_with_the_reason():
    from rcgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="float16 is not supported for training.*bfloat16"):
        parse_args(["--model.dtype", "float16"], check_files=False)
