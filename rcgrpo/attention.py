"""Attention that stays inside each sequence of a packed batch.

``position_ids`` restart at 0 per sequence, but they are NOT a reliable way to
keep packed sequences apart in transformers: with the model's default
``use_cache=True`` (transformers 5.19) the packing detection is skipped and
sequences attend to each other. ``decoder_hidden_states`` therefore passes an
explicit causal mask that keeps sequences apart on CPU (additive: ``eager``
adds a bool mask as 0/1 and silently gets it wrong), and flash-attn's varlen
``cu_seqlens`` on GPU, where an N x N mask is too big. On the mask path the
prompt prefix a group's sequences share is forwarded once
(``rcgrpo.prefix_sharing``).
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from rcgrpo.batch import PackedBatch
from rcgrpo.prefix_sharing import shared_prefix_layout

__all__ = ["block_causal_mask", "additive_mask", "default_attn_implementation", "uses_varlen_attention",
           "decoder_hidden_states"]


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


def decoder_hidden_states(decoder: Callable, config, mask_dtype: torch.dtype, batch: PackedBatch,
                          share_prefixes: bool = True) -> torch.Tensor:
    """Final hidden states [N, H] of a transformers decoder (the causal LM
    without its head) on a packed batch, with ``use_cache=False``:

    * flash-attn implementations (GPU): ``position_ids`` plus explicit varlen
      kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``), no N x N mask;
    * ``sdpa`` / ``eager``: with `share_prefixes`, each shared prompt prefix
      is forwarded once (``rcgrpo.prefix_sharing``) and its rows read by every
      sequence that has it; the mask keeps sequences apart. It is additive,
      in ``mask_dtype``, for both: ``eager`` would add a bool mask as 0/1, and
      ``sdpa``'s CPU kernel would convert a bool mask to an [M, M] float copy
      in every layer's call; one additive mask serves all layers.

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
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"packed forward: attention implementation {impl!r} is not supported; "
            "use 'sdpa' or 'eager' (CPU) or 'flash_attention_2' (GPU)"
        )
    if batch.num_seqs == 1:
        # One sequence needs no mask: plain causal attention lets SDPA use its
        # fused kernel with no [M, M] tensor at all.
        out = decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False)
        return out.last_hidden_state[0]
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
