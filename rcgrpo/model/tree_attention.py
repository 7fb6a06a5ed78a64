"""Tree attention: a micro-batch's prefix tree as one varlen attention call.

``rcgrpo.model.prefix_sharing`` forwards each shared prefix once: the forwarded
rows fall into *nodes* (segments), each a maximal run of tokens owned by one
branch of the tree. A node's tokens attend to the rows of its ancestors up to
where its path leaves each of them, and to themselves causally. Along one
path those ancestor rows are exactly the sequence's positions ``0 ..
start - 1`` in order, so gathering them in front of the node's own rows
gives the node a contiguous key sequence of ``start + len`` rows of which
its ``len`` queries are the last: causal attention *aligned bottom-right*
(query ``i`` sees keys ``0 .. start + i``), which is what flash-attn's
varlen kernel computes when ``seqlen_k > seqlen_q``. So the whole tree is one
call

    Q = the forwarded rows (node after node), K/V = ``key[key_index]``,
    cu_seqlens_q, cu_seqlens_k: per node, its own length and start + length,

and its attention FLOPs are exactly the tree's: no query meets a key it may
not see (a branch off a short cross-group prefix no longer spans the groups
in between, as a key slice did). The gather's backward sums each shared
key's gradient over the nodes that read it.

Back ends (``TREE_BACKENDS``): ``flash`` (flash-attn's
``flash_attn_varlen_func``, CUDA) and ``sdpa`` (torch SDPA, one call per
node over its gathered keys with the bottom-right causal mask: any device).
``varlen_inputs`` is the exact argument list of the flash call, so the tests
check it on CPU against their own implementation of flash-attn's varlen
semantics.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rcgrpo.model.prefix_sharing import SharedPrefixLayout

__all__ = ["TreeAttentionPlan", "tree_attention_plan", "tree_attention", "TREE_BACKENDS", "VarlenInputs",
           "varlen_inputs"]


@dataclass(frozen=True)
class TreeAttentionPlan:
    """One varlen call over a micro-batch's prefix tree (see the module docstring).

    Attributes:
        key_index: [K] int64, the forwarded rows each node attends to, node
            after node: its ancestors' visible rows (root first), then its own.
        cu_seqlens_q: [nodes + 1] int32, node boundaries among the forwarded rows.
        cu_seqlens_k: [nodes + 1] int32, node boundaries in ``key_index``.
        max_seqlen_q, max_seqlen_k: the longest node, the longest key sequence.
        gathers: False when no node has an ancestor (nothing shared: every
            node a whole sequence), so ``key_index`` is every row in order and
            the keys are used as they are, with no copy.
    """

    key_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    gathers: bool = True

    @property
    def num_nodes(self) -> int:
        return int(self.cu_seqlens_q.numel()) - 1

    @property
    def attended_pairs(self) -> int:
        """Query-key pairs computed: per node ``len * start + len * (len + 1) / 2``."""
        q = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).long()
        k = (self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1]).long()
        return int((q * (k - q) + q * (q + 1) // 2).sum())


def tree_attention_plan(layout: SharedPrefixLayout, position_ids: torch.Tensor) -> TreeAttentionPlan:
    """The plan of `layout`'s tree; `position_ids` are the forwarded rows' ([M])."""
    pos = position_ids.detach().to("cpu", torch.long)
    rows = layout.segment_rows
    visible = layout.visible.cpu()
    keys: list[torch.Tensor] = []
    q_lens, k_lens = [], []
    gathers = False
    for q, (lo, hi) in enumerate(rows):
        path = [a for a in torch.nonzero(visible[q]).reshape(-1).tolist() if a != q]  # ancestors, root first
        gathers = gathers or bool(path)
        for a in path:
            a_lo, a_hi = rows[a]
            seen = int(visible[q, a]) - int(pos[a_lo])  # the ancestor's rows below where this path leaves it
            keys.append(torch.arange(a_lo, a_lo + seen))
            if not 0 < seen <= a_hi - a_lo:
                raise AssertionError(f"node {q}: ancestor {a} is seen for {seen} of its {a_hi - a_lo} rows")
        keys.append(torch.arange(lo, hi))
        q_lens.append(hi - lo)
        k_lens.append(int(pos[lo]) + hi - lo)  # the keys are the sequence's positions 0 .. its last
    key_index = torch.cat(keys)
    if key_index.numel() != sum(k_lens):
        raise AssertionError("the gathered keys are not each node's positions from 0: the layout is not a tree")
    cu = lambda lens: F.pad(torch.tensor(lens, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)
    device = layout.segment.device
    return TreeAttentionPlan(key_index=key_index.to(device), cu_seqlens_q=cu(q_lens).to(device),
                             cu_seqlens_k=cu(k_lens).to(device), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens),
                             gathers=gathers)


@dataclass(frozen=True)
class VarlenInputs:
    """flash-attn's ``flash_attn_varlen_func`` arguments, ``[tokens, heads, dim]`` each."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_inputs(plan: TreeAttentionPlan, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor) -> VarlenInputs:
    """transformers' ``[1, heads, M, dim]`` query/key/value -> the varlen call's
    inputs: the queries as they are, the keys and values gathered."""
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed row, got a batch of {query.shape[0]}")
    q = query[0].transpose(0, 1)
    if not plan.gathers:  # every node a whole sequence: plain varlen packing, on every layer's hot path
        return VarlenInputs(q, key[0].transpose(0, 1), value[0].transpose(0, 1), plan.cu_seqlens_q,
                            plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k)
    k = key[0].index_select(1, plan.key_index).transpose(0, 1)
    v = value[0].index_select(1, plan.key_index).transpose(0, 1)
    return VarlenInputs(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k)


def _flash(inputs: VarlenInputs, scale: float | None, dropout: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(inputs.q, inputs.k, inputs.v, inputs.cu_seqlens_q, inputs.cu_seqlens_k,
                                  inputs.max_seqlen_q, inputs.max_seqlen_k, dropout_p=dropout,
                                  softmax_scale=scale, causal=True)


def _sdpa(inputs: VarlenInputs, scale: float | None, dropout: float) -> torch.Tensor:
    """One SDPA call per node over its gathered keys, causal from the bottom right."""
    cu_q, cu_k = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    gqa = inputs.q.shape[1] != inputs.k.shape[1]
    outs = []
    for (q_lo, q_hi), (k_lo, k_hi) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        q = inputs.q[q_lo:q_hi].transpose(0, 1)[None]
        k = inputs.k[k_lo:k_hi].transpose(0, 1)[None]
        v = inputs.v[k_lo:k_hi].transpose(0, 1)[None]
        n_q, n_k = q_hi - q_lo, k_hi - k_lo
        mask = None
        if n_k != n_q:  # SDPA's is_causal aligns top-left: the offset needs a mask
            mask = (torch.arange(n_k, device=q.device)[None, :]
                    <= torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q))[None, None]
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                   dropout_p=dropout, scale=scale, enable_gqa=gqa)[0])
    return torch.cat(outs, dim=1).transpose(0, 1)


TREE_BACKENDS: dict[str, Callable[[VarlenInputs, float | None, float], torch.Tensor]] = {
    "flash": _flash,
    "sdpa": _sdpa,
}


def tree_attention(plan: TreeAttentionPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   backend: str = "sdpa", scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """transformers' ``[1, heads, M, dim]`` query/key/value -> ``[1, M, heads, dim]``,
    each forwarded row attending to what its node may see."""
    out = TREE_BACKENDS[backend](varlen_inputs(plan, query, key, value), scale, dropout)
    return out[None]
