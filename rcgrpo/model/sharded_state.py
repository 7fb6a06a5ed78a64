"""Model and optimizer state of an FSDP-sharded run, in the one-process format.

Checkpoints and stage exports of a torchrun job are exactly what a single
process writes (rcgrpo/run/checkpoint.py: a plain safetensors model folder and
`optimizer.state_dict()` with integer parameter ids). The full state is
gathered onto rank 0's CPU with torch.distributed.checkpoint's state-dict
helpers, rank 0 writes it, and a resume reads it on rank 0 and scatters it
(`broadcast_from_rank0`). So a checkpoint saved at any world size resumes
at any other world size, or in a plain `python -m rcgrpo.train`.

The price: rank 0 holds one full copy of the model and optimizer state in
CPU memory while saving (~3x the fp32 model for AdamW).
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rcgrpo.base import distributed

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Names of each param group's parameters, in the optimizer's order (the
    order `optimizer.state_dict()` numbers them in)."""
    names = {}
    for name, p in model.named_parameters():  # a tied weight is listed once
        names.setdefault(id(p), name)
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def gathered_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU tensors on rank 0 ({} elsewhere); every rank must call.
    Tied weights appear once, under the name `named_parameters` gives them."""
    state = get_model_state_dict(model, options=_GATHER)
    if not distributed.is_main():
        return {}
    keep = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()
                                                       if n in state}
    return {k: v for k, v in state.items() if k in keep}


def gathered_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` of the unsharded model, on rank 0 ({} elsewhere)."""
    by_name = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not distributed.is_main():
        return {}
    ids, state, groups = {}, {}, []
    for group_names, group in zip(_param_names(model, optimizer), by_name["param_groups"]):
        group_ids = []
        for name in group_names:
            ids[name] = len(ids)
            group_ids.append(ids[name])
            if name in by_name["state"]:
                state[ids[name]] = by_name["state"][name]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_ids})
    return {"state": state, "param_groups": groups}


def scatter_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load rank 0's full `state` into every rank's shards (others pass {})."""
    if distributed.is_main():
        expected = {n for n, _ in model.named_parameters()}
        missing = sorted(expected - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks weights {missing[:5]}")
    set_model_state_dict(model, state, options=_SCATTER)


def scatter_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load rank 0's `optimizer.state_dict()`-format `state` into every rank."""
    by_name: dict = {}
    if distributed.is_main():
        names = [n for group in _param_names(model, optimizer) for n in group]
        if len(state["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(state['param_groups'])} optimizer param groups, "
                             f"the optimizer {len(optimizer.param_groups)}")
        by_name = {
            "state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(model, optimizer, by_name, options=_SCATTER)


def restore_sharded(ckpt, model: torch.nn.Module, optimizer, scheduler):
    """Resume an FSDP model from `ckpt` (a verified Checkpoint on rank 0, None
    elsewhere, or None everywhere for a fresh start); every rank calls and
    gets back a Checkpoint-like record (path, step) or None.

    Only rank 0 reads the files, so the checkpoint need not be on every node."""
    from safetensors.torch import load_file

    from rcgrpo.run.checkpoint import CheckpointError

    found = distributed.broadcast_object(None if ckpt is None else (str(ckpt.path), ckpt.step))
    if found is None:
        return None
    model_state, optim_state, sched_state = {}, {}, None
    if distributed.is_main():
        shards = sorted(ckpt.model_dir.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{ckpt.model_dir}: no *.safetensors files (a LoRA checkpoint cannot "
                                  "resume a sharded run)")
        for shard in shards:
            model_state.update(load_file(str(shard)))
        optim_state = ckpt._load_pt("optimizer.pt")
        sched_state = ckpt._load_pt("scheduler.pt")
        ckpt.restore(rng=True)  # rank 0's RNG streams; the data order is seeded
    scatter_model_state(model, _with_tied(model, model_state))
    scatter_optimizer_state(model, optimizer, optim_state)
    scheduler.load_state_dict(distributed.broadcast_object(sched_state))
    return _Found(*found)


class _Found:
    def __init__(self, path: str, step: int):
        self.path, self.step = path, step


def _with_tied(model: torch.nn.Module, state: dict) -> dict:
    """save_pretrained writes a tied weight once; the state-dict loader wants
    it under every name the model's state_dict uses."""
    if not state:
        return state
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = dict(state)
    for aliases in names.values():
        have = next((n for n in aliases if n in state), None)
        for n in aliases:
            if have is not None and n not in out:
                out[n] = state[have]
    return out
