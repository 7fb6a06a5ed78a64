"""Attention that stays inside each sequence of a packed batch.

``position_ids`` restart at 0 per sequence, but they are NOT a reliable way to
keep packed sequences apart in transformers: with the model's default
``use_cache=True`` (transformers 5.19) the packing detection is skipped and
sequences attend to each other. ``decoder_hidden_states`` therefore keeps
them apart explicitly:

* ``sdpa`` and ``flash_attention_2``: the policy's models run under tree
  attention (``use_tree_attention``; ``rcgrpo.model.tree_attention``): the
  micro-batch's prefix tree, each node attending to the rows its path may
  see, in one varlen call (flash-attn) or one SDPA call per node (any
  device). No N x N mask; with ``share_prefixes`` off the tree is every
  sequence on its own, i.e. plain varlen packing.
* ``eager``: an additive [N, N] mask (a bool mask would be added as 0/1);
  for debugging and tests, not for speed.

On both the prompt prefix a micro-batch's sequences share is forwarded once
(``rcgrpo.model.prefix_sharing``).
"""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch

from rcgrpo.model.packing import PackedBatch
from rcgrpo.model.prefix_sharing import prefix_layout, shared_prefix_layout
from rcgrpo.model.tree_attention import tree_attention, tree_attention_plan

__all__ = ["block_causal_mask", "additive_mask", "default_attn_implementation", "uses_varlen_attention",
           "TREE_PREFIX", "use_tree_attention", "decoder_hidden_states"]

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


# The names a policy's models run under: tree attention (rcgrpo.model.tree_attention)
# when a forward passes a `tree_plan`, the base implementation otherwise.
TREE_PREFIX = "rcgrpo_tree:"
TREE_BASES = ("sdpa", "flash_attention_2")


def _tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, tree_plan=None, *, base: str, **kwargs):
    """transformers' attention-function signature ([B, H, T, D] in, [B, T, H, D] out)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if tree_plan is None:
        return ALL_ATTENTION_FUNCTIONS[base](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    backend = "flash" if base.startswith("flash") else "sdpa"
    return tree_attention(tree_plan, query, key, value, backend, scale=scaling, dropout=dropout), None


def use_tree_attention(config) -> None:
    """Run a model whose attention is sdpa or flash_attention_2 under tree
    attention (registered once per base; any other implementation is left
    as it is). Its masks are the base's, so callers that pass no plan (e.g.
    ``generate`` with padding) compute exactly what the base computes."""
    import functools

    base = getattr(config, "_attn_implementation", None)
    if base not in TREE_BASES:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = TREE_PREFIX + base
    AttentionInterface.register(name, functools.partial(_tree_attention_forward, base=base))  # a dict entry
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    config._attn_implementation = name


def decoder_hidden_states(decoder: Callable, config, mask_dtype: torch.dtype, batch: PackedBatch,
                          share_prefixes: bool = True) -> torch.Tensor:
    """Final hidden states [N, H] of a transformers decoder (the causal LM
    without its head) on a packed batch, with ``use_cache=False``:

    * tree attention (what ``sdpa`` and ``flash_attention_2`` run as in a
      policy, ``use_tree_attention``): the forwarded rows and a
      ``tree_plan`` (``rcgrpo.model.tree_attention``), no N x N mask;
    * flash-attn outside a policy: ``position_ids`` plus explicit varlen
      kwargs (``cu_seq_lens_q/k``, ``max_length_q/k``), nothing shared;
    * ``sdpa`` / ``eager`` otherwise: an additive [M, M] mask in
      ``mask_dtype`` (``eager`` would add a bool mask as 0/1; ``sdpa``'s CPU
      kernel would convert a bool mask to a float copy in every layer).

    With `share_prefixes` (all but flash-attn outside a policy), each shared
    prompt prefix is forwarded once (``rcgrpo.model.prefix_sharing``) and its rows
    read by every sequence that has it.

    Other implementations (e.g. flex_attention) are refused rather than
    silently mixing sequences.
    """
    device = batch.input_ids.device
    impl = str(getattr(config, "_attn_implementation", "") or "sdpa")
    tree = impl.startswith(TREE_PREFIX)
    if uses_varlen_attention(config) and not tree:
        cu = batch.cu_seqlens.to(device=device, dtype=torch.int32)
        out = decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
        return out.last_hidden_state[0]
    if impl not in ("sdpa", "eager") and not tree:
        raise ValueError(
            f"packed forward: attention implementation {impl!r} is not supported; "
            "use 'sdpa' or 'eager' (CPU) or 'flash_attention_2' (GPU)"
        )
    if batch.num_seqs == 1:
        # One sequence needs no mask: plain causal attention lets SDPA use its
        # fused kernel with no [M, M] tensor at all.
        out = decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False)
        return out.last_hidden_state[0]
    if tree:
        layout = prefix_layout(batch) if share_prefixes else shared_prefix_layout(batch, share=False)
        ids, pos = batch.input_ids[layout.keep], batch.position_ids[layout.keep]
        out = decoder(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                      tree_plan=tree_attention_plan(layout, pos))
        return out.last_hidden_state[0][layout.expand]
    if share_prefixes:
        layout = prefix_layout(batch)
        ids, pos = batch.input_ids[layout.keep], batch.position_ids[layout.keep]
        mask = layout.attention_mask(pos)
    else:
        layout, ids, pos = None, batch.input_ids, batch.position_ids
        mask = block_causal_mask(batch.cu_seqlens, device=device)
    out = decoder(input_ids=ids[None], position_ids=pos[None], attention_mask=additive_mask(mask, mask_dtype),
                  use_cache=False)
    hidden = out.last_hidden_state[0]
    return hidden if layout is None else hidden[layout.expand]
