"""Give a CPU buffer's physical memory back to the OS while keeping the buffer.

For a buffer that must read as zero when it is used again, freeing it and
allocating it anew is wrong: glibc serves even a GiB-sized request from freed
heap memory when it holds a big enough free chunk, and hands it over with
whatever its last owner wrote there. vLLM's KV cache is such a buffer (its CPU
attention reads the unwritten slots of a block and weights them by 0, so a
stale NaN there poisons every reply; README, "The rollout engine between
phases"). `madvise(MADV_DONTNEED)` on private anonymous memory instead drops
the pages at once and maps a fresh zero page on the next touch: the memory is
returned, the address stays, the content is zero.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

_MADV_DONTNEED = 4  # Linux's value; other systems do not promise zero pages after it


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over every byte of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def discard(storage: torch.UntypedStorage) -> int:
    """Make every byte of `storage` zero and return the whole pages it spans
    to the OS; returns the bytes returned. Where the OS cannot do that
    (not Linux, or madvise refused), the bytes are zeroed in place and stay
    resident (0 returned): the content guarantee holds either way."""
    data = as_bytes(storage)
    start, size = storage.data_ptr(), storage.nbytes()
    page = mmap.PAGESIZE
    first = -start % page  # bytes before the first whole page
    whole = max(0, (size - first) // page * page)
    if _madvise is None or whole == 0 or _madvise(start + first, whole, _MADV_DONTNEED) != 0:
        data.zero_()
        return 0
    data[:first].zero_()  # the partial pages at either end stay mapped: zero them by hand
    data[first + whole:].zero_()
    return whole
