"""What the machine has: a device's total memory (a GPU's, or the host's
under its cgroup limit) and a disk's free space, with the disk check that
refuses a file before it is written.

Read, never estimated: the estimates that compare a run's needs with these
figures live with what they estimate (``rcgrpo.training.memory_plan``,
``rcgrpo.model.loading``'s token-extended copy).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Union

from rcgrpo.base.errors import UserError

__all__ = ["GiB", "gib", "device_memory_bytes", "host_memory_bytes", "cgroup_memory_limit", "DiskPlanError",
           "check_disk"]

GiB = 1 << 30
MEMINFO = "/proc/meminfo"
# cgroup v2, then v1: the first that exists is the one in force.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
DISK_MARGIN_FRACTION = 0.05  # filesystem overhead, a tokenizer and configs beside the weights


def gib(b: float) -> str:
    """Bytes as GiB with one decimal, the unit of every memory and disk message."""
    return f"{b / GiB:.1f}"


def device_memory_bytes(device) -> int:
    """Total memory of `device` (a torch.device, "cuda", "cuda:1", "cpu"): the
    GPU's total on CUDA; on CPU the host's (`host_memory_bytes`)."""
    text = str(device)
    if text.startswith("cuda"):
        return _cuda_memory_bytes(device, text)
    if text != "cpu":
        raise ValueError(f"device_memory_bytes: cuda or cpu, got {text!r}")
    return host_memory_bytes()


def _cuda_memory_bytes(device, text: str) -> int:
    import torch

    index = getattr(device, "index", None)
    if index is None:
        index = int(text.split(":", 1)[1]) if ":" in text else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory)


def host_memory_bytes() -> int:
    """The host's MemTotal, or the cgroup limit when one is set and smaller
    (a container sees the machine's MemTotal but is killed at its limit)."""
    total = _meminfo_total()
    limit = cgroup_memory_limit()
    return limit if limit is not None and 0 < limit < total else total


def _meminfo_total() -> int:
    with open(MEMINFO) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{MEMINFO} has no MemTotal")


def cgroup_memory_limit() -> Optional[int]:
    """This process's cgroup memory limit in bytes; None when no limit file
    can be read or it says none ("max")."""
    for limit_file in CGROUP_MEMORY_LIMITS:
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        return int(raw) if raw.isdigit() else None
    return None


class DiskPlanError(UserError, OSError):
    """A file the run must write would not fit its disk."""


def check_disk(folder: Union[str, os.PathLike], need_bytes: int, what: str, way_out: str) -> None:
    """Refuse, before writing it, `what` (need_bytes, + 5%) when the disk
    holding `folder` (or its nearest existing parent) has less free space."""
    where = Path(folder).expanduser().absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    need = int(need_bytes * (1 + DISK_MARGIN_FRACTION))
    free = shutil.disk_usage(where).free
    if free < need:
        raise DiskPlanError(f"disk plan: {what} needs ~{gib(need)} GiB in {folder}, the disk has "
                            f"{gib(free)} GiB free; {way_out}")
