"""Helpers for the packed batch shared by the chunked and Triton paths.

The reference path deliberately does not use these: it recomputes the same
quantities the slow, obvious way so that it stays an independent oracle.

Packed-batch conventions (see ``kernels/__init__.py`` for the full contract):
``cu_seqlens [S+1]`` holds sequence boundaries; token ``i`` belongs to
sequence ``s`` when ``cu_seqlens[s] <= i < cu_seqlens[s+1]``.
"""

from __future__ import annotations

from typing import Optional

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")


def check_loss_type(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def next_token_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a packed batch into the position-aligned form the kernels take.

    The packed batch marks *generated tokens* (``loss_mask[j]`` is True when
    token ``j`` came from the policy). The log-prob of token ``j`` is read at
    position ``j - 1``, so the kernels take tensors aligned on the
    *predicting* position ``i``: ``targets[i] = input_ids[i + 1]`` and
    ``pred_mask[i] = loss_mask[i + 1]``, both only inside one sequence. The
    last token of each sequence predicts nothing: its target is set to 0 (a
    valid id, so per-row kernels can still read it) and its mask to False.

    Args:
        input_ids: [N] integer token ids of the packed batch.
        loss_mask: [N] bool, True on generated tokens.
        cu_seqlens: [S+1] int32/int64 sequence boundaries, ``cu_seqlens[-1] == N``.

    Returns:
        ``(targets [N] int64, pred_mask [N] bool)``.
    """
    n = input_ids.numel()
    targets = torch.zeros(n, dtype=torch.long, device=input_ids.device)
    pred_mask = torch.zeros(n, dtype=torch.bool, device=input_ids.device)
    if n > 1:
        targets[:-1] = input_ids[1:]
        pred_mask[:-1] = loss_mask[1:].bool()
    ends = cu_seqlens[1:].long() - 1
    ends = ends[ends >= 0]  # empty sequences at the very front end at -1
    targets[ends] = 0
    pred_mask[ends] = False
    return targets, pred_mask


def sequence_ids(positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence index of each packed position, by binary search on ``cu_seqlens``.

    No [B, T] tensor is built: the cost is O(len(positions) * log S).
    """
    return torch.searchsorted(cu_seqlens[1:].long(), positions.long(), right=True)


def loss_token_counts(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S] int64: number of loss tokens in each sequence, from a prefix sum."""
    csum = torch.zeros(loss_mask.numel() + 1, dtype=torch.long, device=loss_mask.device)
    torch.cumsum(loss_mask.long(), 0, out=csum[1:])
    cu = cu_seqlens.long()
    return csum[cu[1:]] - csum[cu[:-1]]


def sequence_loss_weights(
    counts: torch.Tensor, loss_type: str, max_tokens: Optional[float] = None
) -> torch.Tensor:
    """[S] fp32 weight of one loss token of each sequence in the reduced loss.

    Every reduction is ``loss = sum_i w[seq(i)] * l_i`` over loss tokens, so
    the kernels only need this vector (and it gives the gradient directly):

    - grpo: ``1 / (count_s * S_eff)``, S_eff = sequences with >= 1 loss token
      (sequences without loss tokens are left out of the mean);
    - bnpo, dapo: ``1 / total loss tokens`` (identical on one process);
    - dr_grpo: ``1 / (S * max_tokens)``, S counting every sequence and
      ``max_tokens`` defaulting to the largest per-sequence count.

    Kept as tensors so that no host synchronisation is needed.
    """
    check_loss_type(loss_type)
    c = counts.to(torch.float32)
    num_seqs = counts.numel()
    if loss_type == "grpo":
        has = counts > 0
        s_eff = has.sum().clamp(min=1).to(torch.float32)
        return torch.where(has, 1.0 / (c.clamp(min=1.0) * s_eff), torch.zeros_like(c))
    if loss_type in ("bnpo", "dapo"):
        total = c.sum().clamp(min=1.0)
        return (1.0 / total).expand(num_seqs).contiguous()
    # dr_grpo
    if max_tokens is None:
        denom = c.max().clamp(min=1.0) if num_seqs > 0 else c.new_tensor(1.0)
    else:
        denom = c.new_tensor(float(max_tokens))
    return (1.0 / (denom * max(num_seqs, 1))).expand(num_seqs).contiguous()


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[M] int64 positions where ``loss_mask`` is True (one host sync: M is needed
    to size every gathered buffer)."""
    return torch.nonzero(loss_mask.reshape(-1), as_tuple=False).reshape(-1)


def gather_per_token(
    values: Optional[torch.Tensor], positions: torch.Tensor, n_total: int
) -> Optional[torch.Tensor]:
    """Return ``values`` on the loss tokens, as fp32 [M].

    ``values`` may be aligned with the packed batch ([N]) or already gathered
    over the loss tokens in order ([M]). When M == N both readings agree, so
    the shape alone is unambiguous.
    """
    if values is None:
        return None
    values = values.reshape(-1)
    m = positions.numel()
    if values.numel() == n_total:
        return values.index_select(0, positions).to(torch.float32)
    if values.numel() == m:
        return values.to(torch.float32)
    raise ValueError(
        f"per-token tensor has {values.numel()} elements; expected {n_total} (packed) "
        f"or {m} (loss tokens only)"
    )
