"""`model.gradient_checkpointing` applies to full-weight training too (the
paper-qwen7b preset turns it on), and recomputing activations changes no
gradient."""
import torch

from rcgrpo.conditioning.reward_tokens import HIGH_REWARD
from rcgrpo.config import parse_args
from rcgrpo.model.packing import pack
from rcgrpo.model.policy import TrainablePolicy
from rcgrpo.training.losses import LOSS_PATHS, sft_loss
from tests.training.conftest import chat_record


def test_full_weight_training_honours_gradient_checkpointing(policy, tokenizer, model_dir):
    batch = pack([chat_record(tokenizer, "List the files.", "[ls(a=True)]", HIGH_REWARD, 1.0).trajectory()])
    grads = []
    for flag in ("false", "true"):
        cfg = parse_args(["--model.gradient_checkpointing", flag])
        trained = TrainablePolicy.load(model_dir, cfg.model, torch.device("cpu"), reference=False)
        model = trained.model
        assert model.is_gradient_checkpointing == (flag == "true")
        trained.train_mode()
        sft_loss(trained.lm, batch, LOSS_PATHS["fused"])[0].backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 100
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)
