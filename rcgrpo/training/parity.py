"""The tree parity oracle: the shared-prefix forward checked against the
dense one by the run itself.

With prefix sharing on (`model.share_prefixes`), each shared prompt prefix of
a micro-batch is forwarded once and read by every sequence that has it (the
*tree* forward, rcgrpo.model.prefix_sharing). It must give each sequence what the
*dense* forward gives it (every sequence forwarded whole, sharing off), up to
float rounding. A wrong mask, position or gather gives log-probs that only
look plausible: the loss still falls, the old and reference log-probs drift
from the engine's (verl reports such divergence under tree attention), and
nothing fails. So every stage that forwards with sharing checks it, on a
sample of the first micro-batch it trains on that shares a prefix and has
loss tokens (`parity_sample`: a branch and its root, each cut to a window
around the token where they part, the tokens after it scored):

    tree_parity_max_abs = max over its loss tokens of |log p_tree - log p_dense|   (nats)

in eval mode (no dropout) without gradient, under the stage's own autocast,
loss path (`run.fused`) and temperature, and refuses to go on above the
compute dtype's bound (`PARITY_BOUNDS`; `TreeParityError`, one line). The
check comes before the step's first training pass, so a refused step applies
nothing; checkpoints and metrics of earlier steps are kept.

What it covers: the policy's every forward with sharing goes through
`PackedLM.hidden_states`, the code checked here: the training passes, the RL
stages' old log-probs (computed after the check) and the KL reference's
(same code, its own weights), and the RCTP steer probe (its step-0
measurement runs before the first training step, on the weights the check
then sees; a refusal there voids it with the rest).

When: once per stage invocation by default (a resumed stage checks again),
then every `model.parity_check_every` steps where asked. Its cost is two
extra no-gradient forwards of the sample (tree and dense; the training pass
cannot be reused: it runs with dropout and gradient): ~200 tokens, not the
micro-batch (whose dense forward, every sequence whole, cost
the default run ~30 s a stage on 2 CPU cores). It is logged as `tree_parity_s` with the
figure and printed on one line, so it can neither run every step unnoticed
(the Unsloth failure: a silent fallback that ran an extra forward per step)
nor be skipped unnoticed: a stage that forwards nothing shared says so once.
Without gradient the dense forward keeps no activations: its peak stays
below a training pass's.

Under torchrun every rank takes part in the same passes (FSDP's collectives
pair up): each rank checks its own micro-batch (a padding one when it has
none), the figure is the maximum over ranks, and every rank refuses together.
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from rcgrpo.base import distributed
from rcgrpo.base.errors import UserError
from rcgrpo.model.packing import PackedBatch, Trajectory, pack
from rcgrpo.model.policy import PackedLM, TrainablePolicy
from rcgrpo.model.prefix_sharing import (
    MIN_SHARED_TOKENS,
    forwarded_tokens,
    prefix_layout,
    shared_rows,
    with_prefix_layout,
)
from rcgrpo.run.metrics import log_line
from rcgrpo.training.lockstep import padding_batch
from rcgrpo.training.losses import LossPath, token_logprobs

__all__ = ["PARITY_BOUNDS", "PARITY_METRICS", "PARITY_PREFIX", "PARITY_TAIL", "TreeParityError", "parity_bound",
           "parity_sample", "shares_a_prefix", "tree_vs_dense", "ParityOracle"]

# Max |log p_tree - log p_dense| over one micro-batch's loss tokens (nats),
# per compute dtype. Both forwards compute the same sums in differently
# shaped calls (an attention call per tree node over gathered keys; GEMMs
# over another number of rows), so only the order of float additions
# differs. Measured on the 135M model (30 layers; benchmarks/tree_parity.py,
# a BFCL group of four sequences, 600 loss tokens):
#   float32   sdpa 3.4e-5, eager 2.7e-5  -> bound 1e-3 (30x)
#   bfloat16  sdpa 0.36,   eager 0.19    -> bound 2.0 (5.5x)
# and, with a planted bug (every branch one key short of its prefix), 9.5
# nats in both dtypes. bf16 is far noisier: autocast rounds every Linear's
# output to 8 bits of mantissa, so fp32 sums that differ in their last bit
# can round to neighbouring bf16 values (2^-8 apart, relative), and 30 layers
# amplify that. 2 nats (a token's probability off by 7.4x) leaves room for
# deeper models and longer micro-batches, and stays well below the bug.
PARITY_BOUNDS = {torch.float32: 1e-3, torch.bfloat16: 2.0}

# What a check logs in metrics.jsonl at its step (described in rcgrpo.run.metrics.STANDARD_METRICS).
PARITY_METRICS = ("tree_parity_max_abs", "tree_parity_mean_abs", "tree_parity_bound", "tree_parity_tokens",
                  "tree_parity_s")

# The check's sample (parity_sample): the tokens of the shared prefix it keeps, and of each
# sequence after it. The prefix is longer than MIN_SHARED_TOKENS, so the tree forward shares it.
PARITY_PREFIX = 64
PARITY_TAIL = 32

SHARING_OFF = "--model.share_prefixes false"  # the setting a refusal names: every sequence forwarded whole


class TreeParityError(UserError, RuntimeError):
    """The tree forward's log-probs left the dense forward's beyond the bound."""


def parity_bound(compute_dtype: torch.dtype, device_type: str = "cpu") -> tuple[float, str]:
    """(the bound, the precision it is for, in words) for `compute_dtype` on
    `device_type` (PARITY_BOUNDS; float16 is refused by the config). float32
    matmuls on CUDA with TF32 allowed (a torch setting a user may make) round
    to 10 bits of mantissa: they get the bfloat16 bound."""
    name = str(compute_dtype).removeprefix("torch.")
    if compute_dtype == torch.float32 and device_type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return PARITY_BOUNDS[torch.bfloat16], f"{name} with TF32 matmuls"
    if compute_dtype not in PARITY_BOUNDS:
        raise ValueError(f"no tree parity bound for compute dtype {name}")
    return PARITY_BOUNDS[compute_dtype], name


def shares_a_prefix(batch: PackedBatch) -> bool:
    """Whether the tree forward of `batch` differs from the dense one at all:
    it forwards fewer tokens than the batch packs (otherwise its layout is
    every sequence whole, and the two compute the same thing)."""
    return forwarded_tokens(batch, share_prefixes=True) < batch.num_tokens


def parity_sample(batch: PackedBatch) -> PackedBatch:
    """Where the check is cheapest: the first branch of `batch`'s tree and
    the root it reads its prefix from, each cut to a window around the token
    where they part: the last PARITY_PREFIX tokens of the prefix they share
    and up to PARITY_TAIL tokens of each after it, the tails scored. The
    tree forward reads the second's window of the prefix from the first's
    rows, as every branch of the batch reads its prefix: a broken tree (a
    wrong mask, position or gather; one key short: 9.5 nats on the 135M
    model) breaks there too. Both forwards see the same windows, so the
    check compares like with like at ~200 tokens instead of the micro-batch's
    thousands (a BFCL prompt alone is ~2k). `batch` itself when none of its
    sequences reads a prefix of another."""
    layout = prefix_layout(batch)
    cu = batch.cu_seqlens.tolist()
    ids, pos = batch.input_ids.cpu(), batch.position_ids.cpu()
    for b, a in enumerate(layout.seq_root):
        if a == b:
            continue
        shared = shared_rows(cu, ids, pos, a, b)
        if shared >= MIN_SHARED_TOKENS and cu[b] + shared < cu[b + 1]:
            start = shared - min(shared, PARITY_PREFIX)
            windows = [ids[cu[s] + start:min(cu[s] + shared + PARITY_TAIL, cu[s + 1])].tolist() for s in (a, b)]
            sample = pack([Trajectory(w, [0] * (shared - start) + [1] * (len(w) - shared + start)) for w in windows])
            return with_prefix_layout(sample.to(batch.input_ids.device))
    return batch


def _dense(lm: PackedLM) -> PackedLM:
    """`lm` with sharing off: the same decoder, head, dtype and autocast."""
    dense = copy.copy(lm)
    dense.shares_prefixes = False
    return dense


@torch.no_grad()
def tree_vs_dense(lm: PackedLM, batch: PackedBatch, path: LossPath, temperature: float = 1.0) -> torch.Tensor:
    """|log p_tree - log p_dense| (float64) at `batch`'s loss tokens, in
    order. Call it with dropout off; `lm` forwards with sharing (its
    `shares_prefixes`), the other pass without."""
    tree = token_logprobs(lm, batch, path, temperature).double()
    dense = token_logprobs(_dense(lm), batch, path, temperature).double()
    return (tree - dense).abs()


@contextmanager
def _no_dropout(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode for the block, each one's own flag restored
    after (a stage may be in train mode with its dropout modules off)."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


class ParityOracle:
    """The checks of one stage invocation (module docstring). Build it at the
    stage's start; before a step's first training pass, `due(step)` says
    whether that step is checked and `check(step, micros)` checks it."""

    def __init__(self, stage: str, policy: TrainablePolicy, *, every: int, path: LossPath,
                 temperature: float = 1.0):
        self.stage, self.policy, self.every = stage, policy, every
        self.path, self.temperature = path, temperature
        self.bound, self.precision = parity_bound(policy.compute_dtype, policy.device.type)
        self.checked = False
        self._said_unshared = False
        if not policy.lm.shares_prefixes:
            log_line(f"[{stage}] tree parity: not checked: this stage forwards every sequence whole "
                     "(model.share_prefixes false)")

    def due(self, step: int) -> bool:
        """Step `step` (as logged, from 1) is checked: the stage forwards with
        sharing and has not been checked yet, or `every` divides the step."""
        return self.policy.lm.shares_prefixes and (not self.checked or bool(self.every and step % self.every == 0))

    def check(self, step: int, micros: Sequence[PackedBatch]) -> dict[str, float]:
        """The figures of step `step` on the first of this rank's `micros` that
        shares a prefix and has loss tokens (PARITY_METRICS; {} when no rank
        has one: nothing there to check, said once). Every rank calls it;
        raises TreeParityError above the bound."""
        mine = next((m for m in micros if m.num_loss_tokens and shares_a_prefix(m)), None)
        if not distributed.all_reduce_max(int(mine is not None)):
            if not self._said_unshared and not self.checked:
                self._said_unshared = True
                log_line(f"[{self.stage}] tree parity: step {step}'s micro-batches share no prompt prefix "
                         "(their forward is the dense one); checked at the first step whose micro-batches do")
            return {}
        batch = parity_sample(mine) if mine is not None else padding_batch(self.policy.device)  # FSDP: the same passes
        t0 = time.perf_counter()
        with _no_dropout(self.policy.model):
            diff = tree_vs_dense(self.policy.lm, batch, self.path, self.temperature)
        seconds = time.perf_counter() - t0
        if mine is None:
            diff = diff[:0]  # the padding batch's passes pair with the others'; its token is no figure
        local = float(diff.max()) if diff.numel() else 0.0
        # A NaN on any rank must reach all (a NaN figure refuses): max() with NaN first.
        worst = max(distributed.all_gather_objects(local), key=lambda x: math.inf if math.isnan(x) else x)
        sums = distributed.all_reduce_sum({"n": diff.numel(), "abs": float(diff.sum())})
        tokens = round(sums["n"])
        self.checked = True
        figure = f"max |log p tree - log p dense| {worst:.3g} nats over {tokens} loss tokens"
        if not worst <= self.bound:  # NaN included
            raise TreeParityError(
                f"[{self.stage}] step {step}: the tree (shared-prefix) forward disagrees with the dense forward: "
                f"{figure}, above the {self.precision} bound {self.bound:g}; nothing of this step was applied, earlier "
                f"checkpoints are kept; {SHARING_OFF} trains with every sequence forwarded whole")
        log_line(f"[{self.stage}] tree parity at step {step}: {figure} (bound {self.bound:g} for {self.precision}); "
                 f"the check's two extra forwards took {seconds:.2f} s")
        return dict(zip(PARITY_METRICS, (worst, sums["abs"] / tokens, self.bound, tokens, seconds)))
