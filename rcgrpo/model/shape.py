"""A model's shapes, read without loading its weights: what the memory plan
(``rcgrpo.training.memory_plan``) needs of a decoder-only model.

`ModelShape` comes from a config.json dict (`from_config`) or a model folder
(`from_folder`: the config's shapes with the exact parameter count from the
safetensors headers); `model_shape` picks the source for a model name or
path (a local folder, else a hub model's config.json).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from rcgrpo.base import json_input
from rcgrpo.base.errors import UserError

__all__ = ["LAYER_PROJECTIONS", "ModelShape", "ModelShapeError", "model_shape"]

# The Linear layers of a Llama / Qwen2 / Mistral decoder layer: what LoRA's
# "all-linear" adapts there (peft: every Linear but the LM head).
LAYER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelShapeError(UserError, ValueError):
    """A model folder's config.json (or a weights header) cannot be read for its shapes."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only (Llama / Qwen2 / Mistral style) model.

    ``num_attention_heads``, ``num_key_value_heads`` and ``head_dim`` are 0 when
    unknown: then q and kv are taken as ``hidden_size`` wide (plain multi-head).
    """

    params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tied_embeddings: bool
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0

    @property
    def q_dim(self) -> int:
        if self.num_attention_heads and self.head_dim:
            return self.num_attention_heads * self.head_dim
        return self.hidden_size

    @property
    def kv_dim(self) -> int:
        if self.num_key_value_heads and self.head_dim:
            return self.num_key_value_heads * self.head_dim
        return self.hidden_size

    @property
    def root_params(self) -> int:
        """Embeddings + LM head (when untied) + final norm: FSDP2's root unit."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tied_embeddings else 2) + self.hidden_size

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (the average, from the total)."""
        return max(0, self.params - self.root_params) // max(1, self.num_layers)

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a layer (LAYER_PROJECTIONS)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """Shapes and parameter count from a config.json dict (a nested
        ``text_config`` is used when the top level has no ``hidden_size``).

        Biases: q/k/v for model_type qwen2; q/k/v/o when ``attention_bias`` is
        true (Llama, Qwen3); gate/up/down when ``mlp_bias`` is true. Qwen3's
        per-head q/k norms are counted. ``tie_word_embeddings`` defaults to
        false, the default of the Llama, Qwen2 and Mistral configs.
        """
        if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        try:
            h = int(config["hidden_size"])
            inter = int(config["intermediate_size"])
            layers = int(config["num_hidden_layers"])
            vocab = int(config["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config has no {e.args[0]!r}: not a Llama/Qwen2/Mistral-style config") from None
        heads = int(config.get("num_attention_heads") or 0)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or (h // heads if heads else 0))
        tied = bool(config.get("tie_word_embeddings", False))
        q = heads * head_dim if heads and head_dim else h
        kv = kv_heads * head_dim if kv_heads and head_dim else h
        per_layer = _decoder_layer_params(config, h, inter, q, kv, head_dim)
        params = layers * per_layer + vocab * h * (1 if tied else 2) + h
        return cls(params, h, inter, layers, vocab, tied, heads, kv_heads, head_dim)

    @classmethod
    def from_folder(cls, folder: Union[str, os.PathLike]) -> "ModelShape":
        """config.json's shapes with the exact parameter count read from the
        headers of the folder's *.safetensors files (no tensor data is read;
        a tensor stored twice, or a tied LM head stored next to its embedding,
        counts once). Without safetensors files, the count from the config."""
        folder = Path(folder)
        path = folder / "config.json"
        try:
            shape = cls.from_config(json_input.read_file(path, expect=dict))
        except OSError as e:
            raise ModelShapeError(f"model config {path} cannot be read: {e.strerror or e}") from None
        except (ValueError, TypeError) as e:  # not UTF-8 / JSON, too deep, a non-number where a size belongs
            raise ModelShapeError(f"model config {path} cannot be used: {e}") from None
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return shape
        shapes = _stored_tensor_shapes(files)
        if shape.tied_embeddings and any(n.endswith("embed_tokens.weight") for n in shapes):
            shapes = {n: s for n, s in shapes.items() if not n.endswith("lm_head.weight")}
        total = 0
        for dims in shapes.values():
            n = 1
            for d in dims:
                n *= int(d)
            total += n
        vocab = shape.vocab_size
        for name, dims in shapes.items():
            if name.endswith("embed_tokens.weight") and len(dims) == 2:
                vocab = int(dims[0])  # the stored rows (reward tokens may have been added)
        return cls(total, shape.hidden_size, shape.intermediate_size, shape.num_layers, vocab,
                   shape.tied_embeddings, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim)


def _decoder_layer_params(config: dict, h: int, inter: int, q: int, kv: int, head_dim: int) -> int:
    """One decoder layer's parameters: attention (+ its biases and norms, by
    model family), the gated MLP (+ biases), the two RMSNorms."""
    model_type = str(config.get("model_type", ""))
    attn = h * q + 2 * h * kv + q * h
    if model_type == "qwen2":
        attn += q + 2 * kv
    elif config.get("attention_bias"):
        attn += q + 2 * kv + h
    if model_type == "qwen3":
        attn += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * h * inter + ((2 * inter + h) if config.get("mlp_bias") else 0)
    return attn + mlp + 2 * h  # + input and post-attention RMSNorms


def _stored_tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors headers of `files` (no data read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    shapes[name] = list(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises several unrelated types for a bad header
            raise ModelShapeError(f"weights file {path} cannot be read: {e}") from None
    return shapes


def model_shape(name_or_path: str, resolved: Optional[Path] = None) -> Optional[ModelShape]:
    """The shapes the memory plan needs, read without loading weights: a
    resolved or local folder's config.json and safetensors headers, else a hub
    model's config.json; None when neither can be read (offline hub id)."""
    local = resolved or Path(name_or_path).expanduser()
    if local.is_dir():
        return ModelShape.from_folder(local)
    if name_or_path.startswith("embedded:"):
        return None  # resolved first: a cached conversion, no download
    try:
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(name_or_path).to_dict())
    except Exception:  # offline, private, or not a transformers model: resolving will say which
        return None
