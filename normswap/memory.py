"""Process memory: keep the resident set close to what is live while large tensors come and go.

glibc keeps freed heap memory, and loading one block of weights after another fragments the heap,
so the resident set of a block-by-block pass ratchets up (measured: +22 MB per GPT-2-XL block)
unless large allocations get their own mappings and freed memory is handed back.
"""

from __future__ import annotations

import gc
import math
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def release_memory(collect: bool = True) -> None:
    """Hand freed heap memory back to the system. ``collect`` runs the cycle collector first,
    which takes about a second with transformers loaded: worth it between models, not after
    every block, whose weights are freed by reference counting."""
    if collect:
        gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def available_memory() -> int | None:
    """Bytes the system can hand out without swapping (Linux's MemAvailable), or None where
    it does not say."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def map_large_allocations(threshold: int = 4 << 20) -> None:
    """Have glibc serve allocations above ``threshold`` with their own mappings, returned to the
    system when freed. By default glibc raises that threshold (up to 32 MB) after each large free,
    after which block-sized weights come from the heap and fragment it. (Process-wide; glibc only.)"""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(-3, threshold)  # M_MMAP_THRESHOLD


class BufferPool:
    """Large tensors whose memory is handed out again once nothing refers to it any more.

    A block-by-block pass converts every block's weights into new float32 tensors. A fresh
    tensor of that size gets a fresh mapping (``map_large_allocations``), whose pages the kernel
    faults in and zeroes on first write: converting into fresh memory takes several times as long
    as converting into memory already mapped. Blocks repeat the same shapes, so the pool keeps
    every storage it made and hands out one of the right size that no tensor uses now (its use
    count is the pool's alone). The pool holds, for each size, as many storages as were live at
    once, until it is dropped: for blocks of one shape, the peak of one block-by-block pass. Without torch's use count (another torch build), every
    request is a fresh tensor.
    """

    def __init__(self, min_bytes: int = 1 << 20) -> None:

        import torch

        self.min_bytes = min_bytes
        self.storages: dict[int, list] = {}
        self.lock = threading.Lock()
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype``."""

        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes or self._use_count is None:
            return torch.empty(shape, dtype=dtype)
        with self.lock:
            kept = self.storages.setdefault(nbytes, [])
            storage = next((kept[index] for index in range(len(kept)) if self._free(kept, index)), None)
            if storage is None:
                storage = torch.UntypedStorage(nbytes)
                kept.append(storage)
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _free(self, kept: list, index: int) -> bool:
        """No tensor uses ``kept[index]`` (its use count is the pool's alone), and no one holds the
        storage object itself (``Tensor.untyped_storage()`` hands out this very object): its only
        references are the pool's list and ``getrefcount``'s argument."""

        return self._use_count(kept[index]._cdata) == 1 and sys.getrefcount(kept[index]) == 2
