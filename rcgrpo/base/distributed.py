"""One trainer process per rank under `torchrun`: the process group, who
writes, cross-rank reductions, FSDP2 sharding, and failing fast.

Launched without torchrun (no RANK / WORLD_SIZE in the environment) nothing
here creates a process group: every helper then answers for a world of one
(rank 0, main, sums of one), so `python -m rcgrpo.train` runs exactly as a
single process always did.

Under torchrun, each process joins the default group (NCCL on CUDA, gloo on
CPU) with a bounded collective timeout, so a rank that waits on a dead peer
raises instead of hanging. A rank that raises logs its rank and error
(`guarded`) and exits non-zero; torchrun's agent then stops the other ranks
and names the failed one in its summary.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from rcgrpo.base.errors import UserError

__all__ = [
    "World", "DistributedError", "launched", "init", "shutdown", "active", "rank", "world_size", "is_main",
    "barrier", "all_reduce_sum", "all_reduce_max", "all_gather_objects", "broadcast_object", "shard_model",
    "is_sharded", "full_tensor", "guarded", "rank_slice",
]


class DistributedError(RuntimeError):
    """The launch or the world does not fit what the run asks for."""


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # None: a single process without a process group


_collective_device = torch.device("cpu")


def launched() -> bool:
    """True when started by torchrun (or any launcher that sets its variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device_type: str, timeout_s: float = 1800.0) -> World:
    """Join the default process group from torchrun's RANK / WORLD_SIZE /
    LOCAL_RANK / MASTER_ADDR / MASTER_PORT; a no-op without torchrun."""
    global _collective_device
    if not launched():
        return World(0, 1, 0, None)
    rank_, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank_))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise DistributedError(
                f"rank {rank_}: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs are visible; "
                "--nproc_per_node must not exceed the GPUs per node")
        torch.cuda.set_device(local)
        _collective_device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return World(rank_, size, local, backend)


def shutdown() -> None:
    if not active():
        return
    # vLLM's engines made sub-groups of the default group and a world group
    # of their own; they go first, through vLLM, which forgets them (its
    # exit-time engine cleanup would otherwise destroy them again after the
    # default group is gone and print "Invalid process group specified").
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is not None:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()  # also ends the default group
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    """A torchrun world that this process joined. An in-process vLLM engine
    initialises a process group of one in a plain process too; that is not
    a distributed run (sharding a world of one would only cost time)."""
    return launched() and dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Only rank 0 writes logs, metrics, reports, checkpoints and exports."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """Key-wise sums over ranks (float64, so counts stay exact)."""
    if not active() or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


def all_reduce_max(value: int) -> int:
    if not active():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_objects(obj: Any) -> list:
    """Every rank's `obj`, in rank order (small, picklable things only)."""
    if not active():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_slice(items: Sequence, world: int | None = None, rank_: int | None = None) -> tuple[int, int]:
    """[start, end) of this rank's contiguous share of `items`; shares differ
    by at most one item when len(items) is not a multiple of the world size
    (the first len % world ranks take one more)."""
    world = world_size() if world is None else world
    r = rank() if rank_ is None else rank_
    n = len(items)
    base, extra = divmod(n, world)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


# ------------------------------------------------------------------ FSDP2


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model: the classes it declares
    unsplittable (`_no_split_modules`), else `model.model.layers`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers and hasattr(getattr(model, "model", None), "layers"):
        layers = list(model.model.layers)
    if not layers:
        raise DistributedError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


DECODER_METHOD = "fsdp_decoder"  # what policy.TrainablePolicy calls on a sharded model


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 (`fully_shard`) per decoder layer, then the whole model as the
    root group (embeddings, final norm, LM head: a tied head stays tied);
    in place, returns `model`.

    `compute_dtype` (bf16 for a bf16 run of fp32 master weights): the shards
    stay as they are (the optimizer updates them) and each forward gathers
    them cast to `compute_dtype`; gradients are reduced in fp32
    (`MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`). None, or the
    parameters' own dtype, casts nothing (a frozen reference held in the
    compute dtype).

    The losses run the decoder (`model.model`) and then read the LM head's
    weight for the fused projection; they never call the model's own
    forward. So the decoder call is registered as a forward method of the
    root (`model.fsdp_decoder`): it gathers the root parameters first, and
    the root keeps them unsharded until its backward, so the head weight the
    loss reads is the full tensor and its gradient is reduce-scattered with
    the root's at the end of backward.

    Gradients are summed over ranks, not averaged (gradient divide factor 1):
    the trainer normalises each micro-batch by counts taken over all ranks,
    so the sum is exactly the one-process gradient.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if not active():
        raise DistributedError("shard_model needs a process group: launch with torchrun")
    decoder = getattr(model, "model", None)
    if decoder is None:
        raise DistributedError(f"{type(model).__name__} has no `.model` decoder to shard")
    mesh = init_device_mesh(_collective_device.type, (world_size(),))
    own = next(model.parameters()).dtype
    cast = compute_dtype is not None and compute_dtype != own
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if cast else MixedPrecisionPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    setattr(model, DECODER_METHOD, decoder.__call__)
    register_fsdp_forward_method(model, DECODER_METHOD)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # A plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs none.
            m.set_force_sum_reduction_for_comms(True)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective every rank must enter
    in the same order), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------ failures


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Name the rank on any exception, then let it propagate (exit non-zero).

    The peers are blocked in a collective at that point; torchrun's agent
    sees the failed worker and stops them, and the collective timeout bounds
    the wait where no agent does.
    """
    try:
        yield
    except BaseException as exc:
        if active() or launched():
            r, w = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
            if not isinstance(exc, (SystemExit, KeyboardInterrupt)) or (isinstance(exc, SystemExit) and exc.code):
                # A user's error is one line (rcgrpo.base.errors); a bug keeps its traceback.
                trace = "" if isinstance(exc, (UserError, SystemExit)) else "\n" + traceback.format_exc()
                print(f"rcgrpo: rank {r} of {w} failed: {type(exc).__name__}: {exc}{trace}",
                      file=sys.stderr, flush=True)
        raise
