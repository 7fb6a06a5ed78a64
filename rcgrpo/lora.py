"""LoRA adapters (peft) on a loaded policy, for one GPU and a 7B model.

One job: everything that differs when `model.lora.enabled` is true.

* `wrap`: the policy gets adapters; only they train (the base is frozen).
* `adapters_off`: the frozen KL reference of a LoRA run is the same model with
  its adapters switched off, so a 7B run holds one copy of the base weights.
* `merged_weights`: the plain model the engine and the export see, W + B A s
  per adapted layer, computed from the streamed tensors without touching the
  model (merging and unmerging in place would drift in bf16 step after step).
* `save_merged` / `load_adapter`: stage export and checkpoint resume.

peft is an optional extra (`pip install 'rcgrpo[lora]'`): it is imported only
when a LoRA model is made or loaded. A model that was never wrapped cannot be a
PeftModel, so `is_lora` checks without importing it.
"""
from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch

PIP_HINT = "pip install peft==0.21.2 (or pip install 'rcgrpo[lora]')"
ADAPTER_DIR = "adapter"  # inside a stage's exported model folder
ADAPTER_CONFIG = "adapter_config.json"  # what marks a peft adapter folder
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# `<layer>.base_layer.weight`, `<layer>.lora_A.<adapter>.weight`, ...
_LORA_PIECE = re.compile(r"\.(base_layer|lora_[A-Za-z_]+)\.")


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


def wrap(model, lora_cfg, gradient_checkpointing: bool = False):
    """`model` (a transformers causal LM) with LoRA adapters from our
    `LoraConfig`; the base weights are frozen, only the adapters train."""
    peft = _peft()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM",
    ))
    if getattr(model, "is_gradient_checkpointing", False) and not getattr(model, "_require_grads_hooks", None):
        # The frozen embedding's output needs no grad; a (reentrant) checkpointed
        # block fed such an input returns outputs without grad and the adapters
        # inside it would get none. peft 0.21 registers this hook itself when
        # checkpointing is on; we add it only where it did not (never twice).
        model.enable_input_require_grads()
    _lora_layers(wrapped)  # refuses what the merge and the fused losses cannot handle
    return wrapped


@contextmanager
def adapters_off(model):
    """Run `model` as the frozen reference: for a LoRA model its adapters are
    off (and dropout with them, in eval mode) inside the block; any other
    model is already the separate frozen reference and is used as is."""
    if not is_lora(model):
        yield model
        return
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
    losses, which read the head's weight directly.
    """
    _peft()
    from peft.tuners.lora import Linear as LoraLinear, LoraLayer
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
    if not out and is_lora(model):
        raise ValueError("LoRA: the PeftModel has no LoRA layers")
    return out


def merged_linear_weight(weight: torch.Tensor, deltas: Iterable[tuple[torch.Tensor, torch.Tensor, float]],
                         fan_in_fan_out: bool = False) -> torch.Tensor:
    """W + sum(s * B @ A) as a new tensor in W's dtype; the sum is done in fp32
    (bf16 B @ A loses the small update against W's magnitude)."""
    out = weight.float()
    for lora_a, lora_b, scaling in deltas:
        delta = (lora_b.float() @ lora_a.float()) * scaling
        out = out + (delta.T if fan_in_fan_out else delta)  # never in place: W may be the model's own tensor
    return out.to(weight.dtype)


def merged_weights(model, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's (name, tensor) stream from a LoRA model's own stream.

    `tensors` are the full tensors of `model` under its own names (in any
    order; e.g. gathered shard by shard): a LoRA layer's base weight is held
    back until its A and B have passed, then yielded merged under the plain
    name; lora_* tensors are dropped and every other tensor passes through
    renamed, so at most a layer or two is buffered at a time.
    """
    layers = _lora_layers(model)
    pending: dict[str, dict] = {}
    for name, t in tensors:
        name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        piece = _LORA_PIECE.search(name)
        if piece is None:
            yield name, t
            continue
        layer, kind, rest = name[:piece.start()], piece.group(1), name[piece.end():]
        if layer not in layers:
            raise ValueError(f"LoRA merge: {name} belongs to no LoRA layer of the model")
        module, adapters = layers[layer]
        parts = pending.setdefault(layer, {})
        if kind == "base_layer":
            parts[rest] = t  # "weight" / "bias"
        elif kind in ("lora_A", "lora_B"):
            adapter = rest.split(".", 1)[0]
            if adapter not in adapters:
                continue  # an inactive or already merged adapter adds nothing
            parts[(kind, adapter)] = t
        else:
            raise ValueError(f"LoRA merge: unsupported tensor {name}")
        needed = ["weight"] + (["bias"] if module.get_base_layer().bias is not None else [])
        needed += [(k, a) for a in adapters for k in ("lora_A", "lora_B")]
        if all(k in parts for k in needed):
            parts = pending.pop(layer)
            deltas = [(parts[("lora_A", a)], parts[("lora_B", a)], module.scaling[a]) for a in adapters]
            yield f"{layer}.weight", merged_linear_weight(parts["weight"], deltas, module.fan_in_fan_out)
            if "bias" in parts:
                yield f"{layer}.bias", parts["bias"]
    if pending:
        layer, parts = next(iter(pending.items()))
        raise RuntimeError(f"LoRA merge: the weight stream ended before {len(pending)} layer(s) were complete, "
                           f"e.g. {layer} has only {sorted(map(str, parts))}")


def save_merged(model, folder: Path) -> None:
    """Export a LoRA model: the merged plain model in `folder` (a transformers
    and vLLM folder like any other stage's) and the adapter alone, relative to
    the stage's starting model, in `folder/adapter`."""
    from rcgrpo.training.weight_sync import rollout_weights

    folder = Path(folder)
    # CPU copies: a 7B merged state dict beside the training model would not
    # fit on the one GPU; host memory holds it while it is written.
    state = {name: t.to("cpu") for name, t in rollout_weights(model)}
    model.get_base_model().save_pretrained(folder, state_dict=state, safe_serialization=True)
    model.save_pretrained(folder / ADAPTER_DIR, safe_serialization=True)


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
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{path} does not fit the model's adapters (model.lora settings changed?): "
                         f"unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}")
