"""Process memory: keep the resident set close to what is live while large tensors come and go.

glibc keeps freed heap memory, and loading one block of weights after another fragments the heap,
so the resident set of a block-by-block pass ratchets up (measured: +22 MB per GPT-2-XL block)
unless large allocations get their own mappings and freed memory is handed back.
"""

from __future__ import annotations

import gc


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


def map_large_allocations(threshold: int = 4 << 20) -> None:
    """Have glibc serve allocations above ``threshold`` with their own mappings, returned to the
    system when freed. By default glibc raises that threshold (up to 32 MB) after each large free,
    after which block-sized weights come from the heap and fragment it. (Process-wide; glibc only.)"""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
