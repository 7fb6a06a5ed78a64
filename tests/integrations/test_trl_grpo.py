"""The TRL drop-in (rcgrpo_kernels/trl_grpo.py) against TRL's own loss.

A real `GRPOTrainer` of TRL 1.16 on the 135M model prepares one batch as its
training step would (its chat template and tokenisation, its HF generation,
masks, group advantages, old log-probs and the reference's log-probs). On that
batch, TRL's own `GRPOTrainer._compute_loss` is the oracle: the drop-in's loss
and its gradients must equal it for grpo / bnpo / dr_grpo / dapo, beta 0 and
beta > 0, with gradient accumulation 2 (TRL's normalisers divide by it),
with rows shortened or emptied, and with vLLM importance-sampling weights.

Tolerances (fp32; the two sum the same terms in different orders, the
kernel's log-softmax is chunked): loss |diff| <= 1e-5 |loss| + 1e-7;
gradients ||diff|| <= 2e-5 ||g|| over the trained parameters and
max |diff| <= 2e-5 max |g|. Seen on the CPU machine: loss ~1e-8 apart,
gradients ~1.5e-6 relative (every parameter trained).
"""
import pytest
import torch

pytestmark = pytest.mark.slow  # TRL's GRPOTrainer on the 135M model, policy and reference (~20 s in all)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
BETA = 0.1
LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-7, 2e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These passes are a few dozen rows wide: a second thread gains nothing,
    and on the shared 2-core machine OpenMP's spinning under oversubscription
    made each pass ~30x slower (20 s against 0.7 s, measured). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, one_thread):
    """A KernelGRPOTrainer with beta > 0 (so TRL computes reference log-probs)
    and num_iterations = 2 (so it computes old log-probs), and one micro-batch
    of inputs from TRL's own `_prepare_inputs`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from rcgrpo.model.loading import resolve_model_folder
    from rcgrpo_kernels.trl_grpo import KernelGRPOTrainer

    folder = str(resolve_model_folder(None))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    questions = ["Name a colour.", "Count to three.", "Say hello.", "What is two plus two?"]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})

    def reward(completions, **kwargs):  # any reward that differs within a group
        return [float(len(c[0]["content"]) % 7) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=2, num_generations=2,
        gradient_accumulation_steps=2, num_iterations=2, max_completion_length=8, beta=BETA,
        # The kernel's KL is the plain k3 (the drop-in refuses TRL's default ratio-weighted KL).
        use_bias_correction_kl=False, report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no")
    trainer = KernelGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                                processing_class=tokenizer)
    trainer.model.train()
    # What Trainer's training loop sets before its first micro-batch.
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert "old_per_token_logps" in inputs and "ref_per_token_logps" in inputs
    assert inputs["advantages"].abs().max() > 0, "the batch must carry a learning signal"
    # Move the policy off the weights that sampled the batch: the ratio leaves
    # 1 (the clip acts) and the KL to the reference is not 0.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.02)
    # Gradients are compared on the last decoder layer, the final norm and the
    # (tied) head: everything the two losses differ in enters through the
    # head and the last hidden states, and the backward stops early.
    layers = trainer.model.model.layers
    for p in trainer.model.parameters():
        p.requires_grad_(False)
    for module in (layers[-1], trainer.model.model.norm, trainer.model.get_output_embeddings()):
        for p in module.parameters():
            p.requires_grad_(True)
    return trainer, inputs


def _loss_and_grads(trainer, inputs, loss_fn):
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = loss_fn(trainer.model, inputs)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.reshape(-1) for p in params])


def _compare(trainer, inputs, loss_type, beta):
    from trl import GRPOTrainer

    # TRL 1.16 reads loss_type and beta per call in _compute_loss (they shape
    # nothing else once the reference log-probs exist), so one prepared batch
    # serves every case.
    trainer.loss_type, trainer.beta = loss_type, beta
    trl_loss, trl_grad = _loss_and_grads(trainer, inputs, lambda m, i: GRPOTrainer._compute_loss(trainer, m, i))
    clip = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    ours, our_grad = _loss_and_grads(trainer, inputs, trainer._compute_loss)
    assert 0 < clip < 1, "the clip must act on some tokens"
    assert abs(float(ours - trl_loss)) <= LOSS_RTOL * abs(float(trl_loss)) + LOSS_ATOL, (float(ours), float(trl_loss))
    assert float((our_grad - trl_grad).norm()) <= GRAD_RTOL * float(trl_grad.norm())
    assert float((our_grad - trl_grad).abs().max()) <= GRAD_RTOL * float(trl_grad.abs().max())
    return float(trl_loss)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_equal_trl(prepared, loss_type, beta):
    trainer, inputs = prepared
    _compare(trainer, inputs, loss_type, beta)
    if beta:
        assert trainer._metrics["train"]["kl"][-1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_shorter_and_empty_completions(prepared, loss_type):
    """Row 0 with no loss token (what mask_truncated_completions makes of a
    cut completion) and the other rows ending 3 tokens early (as completions
    that stopped, then padding): TRL's grpo still counts the empty row in its
    mean over rows and dr_grpo divides by max_completion_length, not by the
    longest completion, and the drop-in must follow both."""
    trainer, inputs = prepared
    masked = dict(inputs)
    mask = inputs["completion_mask"].clone()
    mask[0] = 0
    mask[:, -3:] = 0
    masked["completion_mask"] = mask
    _compare(trainer, masked, loss_type, BETA)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_vllm_importance_sampling_weights(prepared, loss_type, beta):
    """TRL's truncated importance sampling of vLLM rollouts weights the
    clipped term of each token, not its KL: the drop-in passes the weights as
    token_weights and, with beta > 0, adds the KL as a second fused call.
    The per-token ratios here are planted (this trainer generated with HF);
    TRL's own loss reads them the same way."""
    trainer, inputs = prepared
    weighted = dict(inputs)
    gen = torch.Generator().manual_seed(2)
    weighted["importance_sampling_ratio"] = 0.5 + torch.rand(inputs["completion_mask"].shape, generator=gen)
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        _compare(trainer, weighted, loss_type, beta)
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = saved


def test_unsupported_settings_are_refused(prepared):
    from rcgrpo_kernels.trl_grpo import unsupported_settings

    trainer, _ = prepared
    assert unsupported_settings(trainer) == []
    saved = trainer.loss_type, trainer.top_entropy_quantile
    try:
        trainer.loss_type, trainer.top_entropy_quantile = "cispo", 0.2
        found = unsupported_settings(trainer)
    finally:
        trainer.loss_type, trainer.top_entropy_quantile = saved
    assert any("cispo" in f for f in found) and any("top_entropy_quantile" in f for f in found)


def test_old_import_path_still_works_and_says_where_it_moved(prepared):
    import importlib
    import sys

    import rcgrpo_kernels.trl_grpo

    sys.modules.pop("integrations.trl_grpo", None)
    with pytest.warns(DeprecationWarning, match="moved to rcgrpo_kernels.trl_grpo"):
        old = importlib.import_module("integrations.trl_grpo")
    assert old.KernelGRPOTrainer is rcgrpo_kernels.trl_grpo.KernelGRPOTrainer


def test_the_documented_example_settings_are_accepted(prepared):
    """The settings the module docstring's (and README's) example passes to
    GRPOConfig are ones the drop-in accepts (once it named beta without
    use_bias_correction_kl=False, and was refused at construction)."""
    import rcgrpo_kernels.trl_grpo as drop_in

    documented = {"loss_type": '"dapo"', "beta": "0.04", "use_bias_correction_kl": "False"}
    assert all(f"{k}={v}" in drop_in.__doc__ for k, v in documented.items()), "the docstring's example changed"
    trainer, _ = prepared
    saved = trainer.loss_type, trainer.beta, trainer.args.use_bias_correction_kl
    try:
        trainer.loss_type, trainer.beta, trainer.args.use_bias_correction_kl = "dapo", 0.04, False
        assert drop_in.unsupported_settings(trainer) == []
        trainer.args.use_bias_correction_kl = True
        assert drop_in.unsupported_settings(trainer) == ["use_bias_correction_kl"]
    finally:
        trainer.loss_type, trainer.beta, trainer.args.use_bias_correction_kl = saved
