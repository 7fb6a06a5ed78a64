"""Helpers for the packed batch shared by the chunked and Triton paths.

The reference path deliberately does not use these: it recomputes the same
quantities the slow, obvious way so that it stays an independent oracle.

Packed-batch conventions (see ``rcgrpo_kernels/__init__.py`` for the full contract):
``cu_seqlens [S+1]`` holds sequence boundaries; token ``i`` belongs to
sequence ``s`` when ``cu_seqlens[s] <= i < cu_seqlens[s+1]``.
"""

from __future__ import annotations

from typing import Optional

import torch


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
    if input_ids.dim() != 1 or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be a 1-D integer tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    n = input_ids.numel()
    if loss_mask.numel() != n:
        raise ValueError(f"loss_mask has {loss_mask.numel()} elements, expected N={n}")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [S+1]")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n:
        raise ValueError(f"cu_seqlens must run from 0 to N={n}")
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


def scatter_per_token(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Return ``values`` on the packed positions ([N]): as they are when they
    are [N], placed at the loss positions (fp32, 0 elsewhere) when they are
    [M], the loss tokens in order. The inverse reading of ``gather_per_token``."""
    values = values.reshape(-1)
    mask = loss_mask.reshape(-1).bool()
    n = mask.numel()
    if values.numel() == n:
        return values
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    out[mask] = values.to(torch.float32)  # raises if values is not [M]
    return out
