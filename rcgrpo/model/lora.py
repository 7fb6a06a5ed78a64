"""LoRA adapters (peft) on a loaded policy, for one GPU and a 7B model.

One job: the mechanics of a peft LoRA model. `rcgrpo.model.policy.TrainablePolicy`
is the only caller; it decides when a policy is a LoRA one.

* `wrap`: the policy gets adapters and the two reward-token rows of its input
  embedding become trainable (peft's `trainable_token_indices`; a tied LM head
  follows them, an untied head's rows are held in the adapter frozen);
  everything else is frozen. Trainable tensors are fp32.
* `adapters_off`: the frozen KL reference of a LoRA run is the same model with
  its adapters (and trained token rows) switched off, so a 7B run holds one
  copy of the base weights.
* `merged_weights`: the plain model the engine and the export see, W + B A s
  per adapted layer and the trained token rows in place, computed from the
  streamed tensors without touching the model (merging and unmerging in place
  would drift in bf16 step after step).
* `head_weight`: the LM-head weight the adapted model computes with (the
  fused losses read it directly instead of calling the head).
* `load_adapter`: checkpoint resume.

peft is an optional extra (`pip install 'rcgrpo[lora]'`): it is imported only
when a LoRA model is made or loaded.
"""
from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

PIP_HINT = "pip install peft==0.21.2 (or pip install 'rcgrpo[lora]')"
ADAPTER_DIR = "adapter"  # inside a stage's exported model folder
ADAPTER_CONFIG = "adapter_config.json"  # what marks a peft adapter folder
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# `<layer>.base_layer.weight`, `<layer>.lora_A.<adapter>.weight`, ...
_LORA_PIECE = re.compile(r"\.(base_layer|lora_[A-Za-z_]+)\.")
# `<embedding>.token_adapter.base_layer.weight`,
# `<embedding>.token_adapter.trainable_tokens_delta.<adapter>`
_TOKEN_PIECE = re.compile(r"\.token_adapter\.(base_layer|trainable_tokens_delta)\.")


def is_lora(model) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap(model):
    """The transformers model inside a PeftModel (its layers still carry the
    adapters, so running it runs the adapted policy); any other model as is."""
    return model.get_base_model() if is_lora(model) else model


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"model.lora.enabled needs the `peft` package: {PIP_HINT}") from e
    return peft


def wrap(model, lora_cfg, token_ids: Sequence[int] = (), gradient_checkpointing: bool = False):
    """`model` (a transformers causal LM) with LoRA adapters from our
    `LoraConfig`, plus the input-embedding rows of `token_ids` (the reward
    tokens) as trainable rows; the base weights are frozen, only the adapters
    and those rows train. Every trainable tensor is made fp32: they are the
    master weights the optimizer updates, whatever dtype the frozen base is
    held in."""
    peft = _peft()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # Without the input rows, a reward token's row is frozen at its initial
    # value under LoRA and the policy can never learn to tell the tokens apart.
    indices, frozen_head = list(token_ids) or None, None
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if token_ids and head is not None and head.weight.data_ptr() != embedding.weight.data_ptr():
        # An untied head's reward rows (phrase means, rcgrpo.model.loading) go into
        # the adapter too, frozen: on another machine the base gets those rows
        # from a resize (random) or from its spare rows, and the adapter must
        # carry every value it was trained with (rcgrpo.model.sharing).
        names = {id(m): n for n, m in model.named_modules()}
        indices = {names[id(embedding)]: list(token_ids), names[id(head)]: list(token_ids)}
        frozen_head = f"{_PEFT_PREFIX}{names[id(head)]}.token_adapter."
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM",
        trainable_token_indices=indices,
    ))
    for name, p in wrapped.named_parameters():
        if frozen_head and name.startswith(frozen_head):
            p.requires_grad_(False)
    if getattr(model, "is_gradient_checkpointing", False) and not getattr(model, "_require_grads_hooks", None):
        # The frozen embedding's output needs no grad; a (reentrant) checkpointed
        # block fed such an input returns outputs without grad and the adapters
        # inside it would get none. peft 0.21 registers this hook itself when
        # checkpointing is on; we add it only where it did not (never twice).
        model.enable_input_require_grads()
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    _lora_layers(wrapped)  # refuses what the merge and the fused losses cannot handle
    return wrapped


@contextmanager
def adapters_off(model):
    """Run the LoRA `model` as the frozen reference: its adapters and trained
    token rows are off (and dropout with them, in eval mode) inside the block."""
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def _lora_layers(model) -> dict[str, tuple[object, list[str]]]:
    """Plain module name -> (LoRA layer, adapters to fold into its weight).

    Only plain LoRA on nn.Linear is supported: DoRA and other variants, LoRA
    biases, embedding/conv adapters and modules_to_save would each need their
    own merge rule, and an adapted LM head would be bypassed by the fused
    losses, which read the head's weight directly (trainable token rows are
    the exception: `head_weight` and `merged_weights` apply them).
    """
    _peft()
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    out = {}
    head = unwrap(model).get_output_embeddings()
    for name, module in model.named_modules():
        plain = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        if isinstance(module, ModulesToSaveWrapper):
            raise ValueError(f"LoRA: modules_to_save ({plain}) is not supported")
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear) or not isinstance(module.get_base_layer(), torch.nn.Linear):
            raise ValueError(f"LoRA: only nn.Linear layers can take adapters; {plain} is {type(module).__name__}")
        if module is head or module.get_base_layer() is head:
            raise ValueError("LoRA: the LM head cannot take adapters (the fused losses read its weight directly); "
                             "remove it from model.lora.target_modules")
        if any(module.lora_variant.values()) or any(module.use_dora.values()) or any(module.lora_bias.values()):
            raise ValueError(f"LoRA: {plain} uses DoRA / a LoRA variant / lora_bias, which are not supported")
        # What the layer's forward adds right now: active, enabled, not already
        # merged into the base weight.
        adapters = [] if module.disable_adapters else [
            a for a in module.active_adapters if a in module.lora_A and a not in module.merged_adapters]
        out[plain] = (module, adapters)
    if not out:
        raise ValueError("LoRA: the PeftModel has no LoRA layers")
    return out


def _token_layers(model) -> dict[str, object]:
    """Plain embedding name -> its peft TrainableTokensLayer (the trained
    rows); a tied LM head shares the embedding's layer and is not listed."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, TrainableTokensLayer) and module.tied_adapter is None:
            plain = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
            out[plain.removesuffix(".token_adapter")] = module
    return out


def _active(layer) -> list[str]:
    """The adapters a peft layer's forward applies right now."""
    if layer.disable_adapters:
        return []
    return [a for a in layer.active_adapters if a not in layer.merged_adapters]


def head_weight(model) -> torch.Tensor:
    """The LM-head weight the LoRA `model` computes its logits with: the plain
    head's weight, or with a tied head whose token rows train, the weight
    with those rows in place (differentiable in the rows)."""
    head = unwrap(model).get_output_embeddings()
    layer = getattr(head, "token_adapter", None)
    if layer is None:
        return head.weight
    active = [a for a in _active(layer) if a in layer.token_indices]
    return layer.get_merged_weights(active) if active else layer.get_base_layer().weight


def merged_linear_weight(weight: torch.Tensor, deltas: Iterable[tuple[torch.Tensor, torch.Tensor, float]],
                         fan_in_fan_out: bool = False) -> torch.Tensor:
    """W + sum(s * B @ A) as a new fp32 tensor (bf16 would lose the small
    update against W's magnitude; the consumer casts to what it stores)."""
    out = weight.float()
    for lora_a, lora_b, scaling in deltas:
        delta = (lora_b.float() @ lora_a.float()) * scaling
        out = out + (delta.T if fan_in_fan_out else delta)  # never in place: W may be the model's own tensor
    return out


def merged_weights(model, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's (name, tensor) stream from a LoRA model's own stream.

    `tensors` are the full tensors of `model` under its own names (in any
    order; e.g. gathered shard by shard): a LoRA layer's base weight is held
    back until its A and B have passed, then yielded merged (fp32) under the
    plain name; an embedding with trained token rows likewise waits for its
    rows; lora_* tensors are dropped and every other tensor passes through
    renamed, so at most a layer or two is buffered at a time.
    """
    layers, token_layers = _lora_layers(model), _token_layers(model)
    pending: dict[str, dict] = {}

    def needed(layer: str) -> list:
        if layer in token_layers:
            return ["weight"] + [("rows", a) for a in _active(token_layers[layer])]
        module, adapters = layers[layer]
        keys = ["weight"] + (["bias"] if module.get_base_layer().bias is not None else [])
        return keys + [(k, a) for a in adapters for k in ("lora_A", "lora_B")]

    def merged(layer: str, parts: dict) -> Iterator[tuple[str, torch.Tensor]]:
        if layer in token_layers:
            tokens = token_layers[layer]
            weight = parts["weight"].float()
            for a in _active(tokens):
                index = torch.as_tensor(tokens.token_indices[a], device=weight.device)
                weight = weight.index_copy(0, index, parts[("rows", a)].float())
            yield f"{layer}.weight", weight
            return
        module, adapters = layers[layer]
        deltas = [(parts[("lora_A", a)], parts[("lora_B", a)], module.scaling[a]) for a in adapters]
        yield f"{layer}.weight", merged_linear_weight(parts["weight"], deltas, module.fan_in_fan_out)
        if "bias" in parts:
            yield f"{layer}.bias", parts["bias"]

    for name, t in tensors:
        name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        piece = _TOKEN_PIECE.search(name) or _LORA_PIECE.search(name)
        if piece is None:
            yield name, t
            continue
        layer, kind, rest = name[:piece.start()], piece.group(1), name[piece.end():]
        if layer not in layers and layer not in token_layers:
            raise ValueError(f"LoRA merge: {name} belongs to no LoRA layer of the model")
        parts = pending.setdefault(layer, {})
        if kind == "base_layer":
            parts[rest] = t  # "weight" / "bias"
        elif kind in ("lora_A", "lora_B", "trainable_tokens_delta"):
            adapter = rest.split(".", 1)[0]
            key = ("rows", adapter) if kind == "trainable_tokens_delta" else (kind, adapter)
            if key not in needed(layer):
                continue  # an inactive or already merged adapter adds nothing
            parts[key] = t
        else:
            raise ValueError(f"LoRA merge: unsupported tensor {name}")
        if all(k in parts for k in needed(layer)):
            yield from merged(layer, pending.pop(layer))
    if pending:
        layer, parts = next(iter(pending.items()))
        raise RuntimeError(f"LoRA merge: the weight stream ended before {len(pending)} layer(s) were complete, "
                           f"e.g. {layer} has only {sorted(map(str, parts))}")


def load_adapter(model, folder: Path) -> None:
    """Copy the adapter weights saved in `folder` (by `model.save_pretrained`)
    into the LoRA model `model`, in place."""
    from safetensors.torch import load_file

    _peft()
    from peft import set_peft_model_state_dict

    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was not saved from a LoRA run "
                                "(resume it with model.lora.enabled false)")
    result = set_peft_model_state_dict(model, load_file(str(path)))
    # A tied LM head's token rows are the embedding's (saved once, under the embedding).
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    tied = [name + "." for name, m in model.named_modules() if isinstance(m, TrainableTokensLayer) and m.tied_adapter]
    missing = [k for k in result.missing_keys if (".lora_" in k or "trainable_tokens_delta" in k)
               and not k.startswith(tuple(tied))]
    if result.unexpected_keys or missing:
        raise ValueError(f"{path} does not fit the model's adapters (model.lora settings changed?): "
                         f"unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}")
