"""2 ranks (FSDP2 over gloo) and 1 plain process make the same RC-GRPO update
on the same global batch: rollouts fixed in a file, groups split by rank, the
ranks with different micro-batch counts (lock-step padding), a KL reference
sharded too. The one process forwards every sequence whole and the ranks
forward each group's shared prompt once (tree attention under FSDP2), so the
equality also holds the tree to the dense forward and backward. Adam's first step moves every weight by ~lr whatever the
gradient's scale, so the scale is checked through the logged loss and the
global gradient norm, and the direction through the updated weights."""
import json

import pytest
import torch

from tests.distributed.conftest import python, torchrun
from tests.distributed.update_worker import LR, build_rollouts

pytestmark = pytest.mark.slow  # torchrun: 2 ranks and 1 process each train the model (~50 s, ~18 s)

WORKER = ["-m", "tests.distributed.update_worker"]


def test_two_ranks_make_the_one_process_update(tmp_path, tokenizer, model_dir):
    from safetensors.torch import load_file

    rollouts = build_rollouts(tokenizer, tmp_path / "rollouts.jsonl")
    one = python(WORKER + [str(rollouts), str(tmp_path / "one"), "float32", "", "false"])  # dense
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(2, WORKER + [str(rollouts), str(tmp_path / "two")])  # tree (share_prefixes, the default)
    assert two.returncode == 0, two.stderr[-3000:]

    a, b = (json.loads((tmp_path / d / "stats.json").read_text()) for d in ("one", "two"))
    assert a["loss_tokens"] == b["loss_tokens"] > 0 and a["batch_tokens"] == b["batch_tokens"]
    assert b["forward_tokens"] < a["forward_tokens"] == a["batch_tokens"]  # the ranks shared, the process did not
    assert abs(a["loss"]) > 1e-4  # the reference differs from the policy: a real KL term
    assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]) + 1e-7, (a["loss"], b["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])
    assert a["adv_std"] == b["adv_std"]

    base = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    wa, wb = (torch.load(tmp_path / d / "weights.pt") for d in ("one", "two"))
    assert wa.keys() == wb.keys()
    worst, moved, far, total = 0.0, 0, 0, 0
    for name in wa:
        da, db = wa[name] - base[name], wb[name] - base[name]
        diff = (da - db).abs()
        worst = max(worst, float(diff.max()))
        far += int((diff > 0.01 * LR).sum())
        moved += int((da.abs() > LR / 2).sum())
        total += da.numel()
    assert moved > 0.5 * total  # the update did move the model
    # Sums in another order leave ~1e-6 relative noise in the gradient; Adam
    # amplifies it only where a gradient is ~1e-8 (its eps): a handful of
    # weights. A missing or mis-weighted rank moves a large share by ~lr.
    print(f"max |update diff| {worst:.3g} (lr {LR}); {far} of {total} weights differ by > 1% of lr")
    assert far < 1e-5 * total, f"{far} of {total} weights differ by more than 1% of lr"
    assert worst < 0.25 * LR, f"updates differ by up to {worst} (lr {LR})"


def test_two_ranks_with_the_mixed_precision_policy_make_the_one_process_bf16_update(tmp_path, tokenizer):
    """`model.dtype bfloat16`: one process runs under autocast, two ranks under
    FSDP2's MixedPrecisionPolicy (bf16 gathers, fp32 gradient reduction) over
    fp32 shards. The arithmetic differs in where bf16 rounding happens, so
    the tolerance is bf16's; the master weights and AdamW state stay fp32.
    A tiny model with the real tokenizer: bf16 matmuls are slow on this CPU,
    and the mechanics do not depend on the size."""
    from safetensors.torch import load_file

    from tests.training.conftest import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path / "tiny", tokenizer)
    rollouts = build_rollouts(tokenizer, tmp_path / "rollouts.jsonl")
    one = python(WORKER + [str(rollouts), str(tmp_path / "one"), "bfloat16", str(model_dir)])
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(2, WORKER + [str(rollouts), str(tmp_path / "two"), "bfloat16", str(model_dir)])
    assert two.returncode == 0, two.stderr[-3000:]

    a, b = (json.loads((tmp_path / d / "stats.json").read_text()) for d in ("one", "two"))
    for stats in (a, b):
        assert stats["weight_dtypes"] == ["torch.float32"] and stats["optimizer_dtypes"] == ["torch.float32"]
    assert a["loss_tokens"] == b["loss_tokens"] > 0 and a["adv_std"] == b["adv_std"]
    # The loss is near 0 (advantages sum to 0 per group; a small KL): absolute.
    assert abs(a["loss"] - b["loss"]) <= 1e-3, (a["loss"], b["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * a["grad_norm"], (a["grad_norm"], b["grad_norm"])

    base = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    wa, wb = (torch.load(tmp_path / d / "weights.pt") for d in ("one", "two"))
    da = torch.cat([(wa[n] - base[n]).flatten() for n in sorted(wa)]).double()
    db = torch.cat([(wb[n] - base[n]).flatten() for n in sorted(wa)]).double()
    cosine = float(da @ db / (da.norm() * db.norm()))
    print(f"bf16: loss {a['loss']:.6f} vs {b['loss']:.6f}, grad norm {a['grad_norm']:.4f} vs {b['grad_norm']:.4f}, "
          f"update cosine {cosine:.4f}")
    assert float(da.norm()) > 0.5 * LR * da.numel() ** 0.5  # the update moved the fp32 masters
    assert cosine > 0.9, cosine
