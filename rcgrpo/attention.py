"""Attention that stays inside each sequence of a packed batch.

``position_ids`` restart at 0 per sequence, but they are NOT a reliable way to
keep packed sequences apart in transformers: with the model's default
``use_cache=True`` (transformers 5.19) the packing detection is skipped and
sequences attend to each other. ``decoder_hidden_states`` therefore keeps
them apart explicitly:

* ``sdpa`` (CPU, and GPUs without flash-attn): the policy's models run
  ``SEGMENT_SDPA``, torch's SDPA called once per segment of the batch (a
  sequence, or the tail of one that shares a prefix) over just the keys
  that segment may see. One SDPA call with an [N, N] mask computes every
  query-key pair, masked or not (``benchmarks/test_packed_attention.py``:
  8 sequences in 4,096 tokens cost 7-8x), and on CPU keeps an [N, N] float
  copy per layer for the backward pass.
* ``eager``: an additive [N, N] mask (a bool mask would be added as 0/1).
* flash-attn (GPU): varlen ``cu_seqlens``, where an N x N mask is too big.

On the first two the prompt prefix a group's sequences share is forwarded
once (``rcgrpo.prefix_sharing``).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from rcgrpo.batch import PackedBatch
from rcgrpo.prefix_sharing import SharedPrefixLayout, shared_prefix_layout

__all__ = ["block_causal_mask", "additive_mask", "default_attn_implementation", "uses_varlen_attention",
           "SEGMENT_SDPA", "use_segment_sdpa", "AttentionSegment", "segment_plan", "decoder_hidden_states"]

# The name the policy's sdpa models run under (registered with transformers'
# attention and mask interfaces): SDPA per segment when a forward passes a
# `segment_plan`, plain SDPA otherwise (generation, any other caller).
SEGMENT_SDPA = "rcgrpo_segment_sdpa"


def block_causal_mask(cu_seqlens: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """[1, 1, N, N] bool: True where query i may attend key j (same sequence, j <= i).

    N^2 memory: meant for CPU-sized batches and for tests; GPUs use varlen
    flash attention instead.
    """
    cu = cu_seqlens.long().cpu()
    lens = cu[1:] - cu[:-1]
    n = int(cu[-1])
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    idx = torch.arange(n)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None].to(device if device is not None else cu_seqlens.device)


def additive_mask(bool_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, the dtype's most negative value where not: the form the
    ``eager`` attention adds to its scores (a bool mask would be added as 0/1)."""
    out = torch.zeros(bool_mask.shape, dtype=dtype, device=bool_mask.device)
    return out.masked_fill_(~bool_mask, torch.finfo(dtype).min)


def default_attn_implementation(device: torch.device | str) -> str:
    """What ``model.attn_implementation = "auto"`` means: flash-attn's varlen
    kernel on CUDA when the package is installed (no N x N mask), else sdpa."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def uses_varlen_attention(config) -> bool:
    """True when the model's attention is a flash-attn implementation, which
    takes sequence boundaries (cu_seqlens) instead of an N x N mask."""
    return "flash" in str(getattr(config, "_attn_implementation", "") or "")


@dataclass(frozen=True)
class AttentionSegment:
    """One SDPA call: queries ``rows[0]:rows[1]`` of the forwarded tokens
    attend to keys ``keys_from:rows[1]`` under ``mask`` ([1, 1, q, k] bool),
    or causally to their own rows when ``mask`` is None (a root)."""

    rows: tuple[int, int]
    keys_from: int
    mask: Optional[torch.Tensor]


def segment_plan(layout: SharedPrefixLayout, position_ids: torch.Tensor) -> list[AttentionSegment]:
    """The SDPA calls of one packed forward, a segment each, in row order.

    A root attends to itself causally (SDPA's causal kernel, no mask). A
    branch attends to the key rows from its earliest ancestor's first row to
    its own last (a slice, so the keys are views, never copies), with the
    layout's visibility over that range as its mask. What it computes beyond
    the pairs it needs is the segments in between: sibling branches (tails
    of a few hundred tokens) or, for a branch off another group's prompt
    (BFCL's 149-token preamble), the groups between the two. Never more
    pairs than one [M, M] masked call; gathering just the visible rows for
    such branches would cut the rest."""
    plan = []
    for q, (lo, hi) in enumerate(layout.segment_rows):
        ancestors = [a for a in torch.nonzero(layout.visible[q]).reshape(-1).tolist() if a != q]
        if not ancestors:
            plan.append(AttentionSegment((lo, hi), lo, None))
            continue
        first = layout.segment_rows[min(ancestors)][0]
        mask = layout.visibility(q, position_ids, first, hi)
        plan.append(AttentionSegment((lo, hi), first, mask[None, None]))
    return plan


def _segment_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, segment_plan: list[AttentionSegment] | None = None,
                            **kwargs):
    """transformers' attention-function signature ([B, H, T, D] in, [B, T, H, D]
    out). Without a plan: transformers' own SDPA, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if segment_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    outs = []
    for part in segment_plan:
        lo, hi = part.rows
        outs.append(F.scaled_dot_product_attention(
            query[:, :, lo:hi], key[:, :, part.keys_from:hi], value[:, :, part.keys_from:hi],
            attn_mask=part.mask, is_causal=part.mask is None, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1]))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def use_segment_sdpa(config) -> None:
    """Run a transformers model whose attention is ``sdpa`` under
    ``SEGMENT_SDPA`` (registered once; any other implementation is left as
    it is). Its masks are built as for sdpa, so callers that pass no plan
    (e.g. ``generate`` with padding) compute exactly what sdpa computes."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SEGMENT_SDPA, _segment_sdpa_attention)  # idempotent: a dict entry
    AttentionMaskInterface.register(SEGMENT_SDPA, sdpa_mask)
    config._attn_implementation = SEGMENT_SDPA


def decoder_hidden_states(decoder: Callable, config, mask_dtype: torch.dtype, batch: PackedBatch,
                          share_prefixes: bool = True) -> torch.Tensor:
    """Final hidden states [N, H] of a transformers decoder (the causal LM
    without its head) on a packed batch, with ``use_cache=False``:

    * flash-attn implementations (GPU): ``position_ids`` plus explicit varlen
      kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``), no N x N mask;
    * ``SEGMENT_SDPA`` (what ``sdpa`` runs as in a policy): one SDPA call
      per segment (``segment_plan``);
    * ``sdpa`` / ``eager`` otherwise: an additive [M, M] mask in
      ``mask_dtype`` (``eager`` would add a bool mask as 0/1; ``sdpa``'s CPU
      kernel would convert a bool mask to a float copy in every layer).

    With `share_prefixes` (all but flash-attn), each shared prompt prefix is
    forwarded once (``rcgrpo.prefix_sharing``) and its rows read by every
    sequence that has it.

    Other implementations (e.g. flex_attention) are refused rather than
    silently mixing sequences.
    """
    device = batch.input_ids.device
    impl = str(getattr(config, "_attn_implementation", "") or "sdpa")
    if uses_varlen_attention(config):
        cu = batch.cu_seqlens.to(device=device, dtype=torch.int32)
        out = decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
        return out.last_hidden_state[0]
    if impl not in ("sdpa", "eager", SEGMENT_SDPA):
        raise ValueError(
            f"packed forward: attention implementation {impl!r} is not supported; "
            "use 'sdpa' or 'eager' (CPU) or 'flash_attention_2' (GPU)"
        )
    if batch.num_seqs == 1:
        # One sequence needs no mask: plain causal attention lets SDPA use its
        # fused kernel with no [M, M] tensor at all.
        out = decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False)
        return out.last_hidden_state[0]
    if impl == SEGMENT_SDPA:
        layout = shared_prefix_layout(batch, share=share_prefixes)
        ids, pos = batch.input_ids[layout.keep], batch.position_ids[layout.keep]
        out = decoder(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                      segment_plan=segment_plan(layout, pos))
        return out.last_hidden_state[0][layout.expand]
    if share_prefixes:
        layout = shared_prefix_layout(batch)
        ids, pos = batch.input_ids[layout.keep], batch.position_ids[layout.keep]
        mask = layout.attention_mask(pos)
    else:
        layout, ids, pos = None, batch.input_ids, batch.position_ids
        mask = block_causal_mask(batch.cu_seqlens, device=device)
    out = decoder(input_ids=ids[None], position_ids=pos[None], attention_mask=additive_mask(mask, mask_dtype),
                  use_cache=False)
    hidden = out.last_hidden_state[0]
    return hidden if layout is None else hidden[layout.expand]
