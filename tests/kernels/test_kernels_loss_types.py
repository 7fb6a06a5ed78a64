"""The loss-type registry (rcgrpo_kernels/loss_types.py): the built-in reductions'
weights by hand, and a newly registered reduction running on every path,
forward and backward, against a loss written out in plain Python."""

import pytest
import torch
from kernels_testlib import (
    DEVICE,
    IMPLS,
    SEQLENS,
    assert_close,
    cu_of,
    leaf,
    loss_mask_for,
    old_ref_for,
    packed_problem,
    triton_ready,
)

import rcgrpo_kernels
from rcgrpo_kernels import loss_types


def test_builtin_sequence_weights_by_hand():
    counts = torch.tensor([1, 0, 2, 0])
    w = loss_types.sequence_weights(counts, "grpo")
    torch.testing.assert_close(w, torch.tensor([1 / 2, 0.0, 1 / 4, 0.0]))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "bnpo"), torch.full((4,), 1 / 3))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "dapo"), torch.full((4,), 1 / 3))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "dr_grpo"), torch.full((4,), 1 / 8))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "dr_grpo", 10), torch.full((4,), 1 / 40))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "token-sum"), torch.ones(4))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "seq-mean-token-sum"), torch.full((4,), 1 / 2))
    torch.testing.assert_close(loss_types.sequence_weights(counts, "seq-mean-token-sum-norm", 10),
                               torch.full((4,), 1 / 10))
    # no loss token anywhere, or no sequence at all: every weight is finite
    for lt in rcgrpo_kernels.LOSS_TYPES:
        assert torch.isfinite(loss_types.sequence_weights(torch.zeros(3, dtype=torch.long), lt)).all()
        assert loss_types.sequence_weights(torch.zeros(0, dtype=torch.long), lt).numel() == 0


def test_normaliser_counts_the_selected_sequences():
    counts = torch.tensor([3, 0, 2, 5])
    keep = torch.tensor([True, True, False, True])
    got = {name: (int(lt.count(counts)), int(lt.count(counts, keep))) for name, lt in rcgrpo_kernels.LOSS_TYPES.items()}
    assert got == {"grpo": (3, 2), "bnpo": (10, 8), "dapo": (10, 8), "dr_grpo": (4, 3),
                   "token-sum": (1, 1), "seq-mean-token-sum": (3, 2), "seq-mean-token-sum-norm": (1, 1)}
    assert [name for name, lt in rcgrpo_kernels.LOSS_TYPES.items() if not lt.divides] == [
        "token-sum", "seq-mean-token-sum-norm"]


def test_names_and_errors():
    assert tuple(rcgrpo_kernels.LOSS_TYPES) == ("grpo", "bnpo", "dapo", "dr_grpo", "token-sum", "seq-mean-token-sum",
                                         "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"loss_type must be one of \('grpo', .*'seq-mean-token-sum-norm'\), got 'sum'"):
        rcgrpo_kernels.get_loss_type("sum")
    with pytest.raises(ValueError, match="already registered"):
        rcgrpo_kernels.register_loss_type(rcgrpo_kernels.LossType("grpo", lambda c, k: k.sum()))
    with pytest.raises(ValueError, match="choose one of"):
        rcgrpo_kernels.LossType("both", lambda c, k: k.sum(), mean_within_sequence=True, scaled_by_max_tokens=True)
    with pytest.raises(TypeError):  # the registry is read-only from outside
        rcgrpo_kernels.LOSS_TYPES["x"] = None  # type: ignore[index]


@pytest.fixture
def sequence_sum_type():
    """A reduction the built-ins do not have: each sequence's token sum,
    averaged over the sequences that have loss tokens."""
    lt = rcgrpo_kernels.register_loss_type(rcgrpo_kernels.LossType(
        "seq_sum_mean", lambda counts, keep: ((counts > 0) & keep).sum(), description="test only"))
    yield lt.name
    loss_types._REGISTRY.pop(lt.name)


def _by_hand(per_token, mask, seqlens):
    """sum over sequences with loss tokens of (sum of their token losses) / that count."""
    total, with_tokens, start = 0.0, 0, 0
    for n in seqlens:
        m = mask[start:start + n]
        if m.any():
            total += float(per_token[start:start + n][m].sum())
            with_tokens += 1
        start += n
    return total / max(with_tokens, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_registered_type_runs_on_every_path(impl, sequence_sum_type):
    if impl == "triton":
        triton_ready()
    gen = torch.Generator().manual_seed(3)
    n, s = sum(SEQLENS), len(SEQLENS)
    cu = cu_of(SEQLENS)
    mask = loss_mask_for(SEQLENS)
    logp = leaf((-2.0 + torch.randn(n, generator=gen)).to(DEVICE))
    adv = torch.randn(s, generator=gen).to(DEVICE)
    loss, _ = rcgrpo_kernels.grpo_loss(logp, None, None, adv, mask, cu, loss_type=sequence_sum_type, impl=impl)
    # on-policy, beta 0: each loss token's loss is -A of its sequence, its gradient too
    adv_tok = torch.repeat_interleave(adv.cpu(), torch.tensor(SEQLENS))
    assert loss.item() == pytest.approx(_by_hand(-adv_tok, mask.cpu(), SEQLENS), rel=1e-6)
    loss.backward()
    with_tokens = sum(1 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if mask[a:b].any())
    want = torch.where(mask.cpu(), -adv_tok / with_tokens, torch.zeros(n))
    assert_close(logp.grad.cpu(), want, what="dlogp")


@pytest.mark.parametrize("impl", IMPLS)
def test_registered_type_in_the_fused_linear_loss(impl, sequence_sum_type):
    """Off-policy (old log-probs spread around the current ones, so some
    ratios clip), forward and backward: seq_sum_mean equals grpo's mean of
    token means with each sequence's advantage scaled by its token count."""
    if impl == "triton":
        triton_ready()
    p = packed_problem()
    old, _ = old_ref_for(p)
    cu, mask = p["cu_seqlens"], p["loss_mask"]
    counts = torch.tensor([int(mask[a:b].sum()) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    scaled = p["advantages"] * counts.to(p["advantages"])

    def run(loss_type, advantages, impl):
        hidden, weight = leaf(p["hidden"]), leaf(p["weight"])
        loss, stats = rcgrpo_kernels.fused_linear_grpo_loss(hidden, weight, p["targets"], advantages, mask, cu, old_logp=old,
                                                     loss_type=loss_type, impl=impl)
        loss.backward()
        return loss, stats, hidden.grad, weight.grad

    got, got_stats, dh, dw = run(sequence_sum_type, p["advantages"], impl)
    want, want_stats, want_dh, want_dw = run("grpo", scaled, "reference")
    assert 0 < want_stats["clip_frac"].item() < 1
    assert_close(got, want, what="loss")
    assert_close(dh, want_dh, what="dhidden", grad=True)
    assert_close(dw, want_dw, what="dweight", grad=True)
