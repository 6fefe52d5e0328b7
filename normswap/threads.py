"""How many CPU threads torch's intra-op pool gets for normswap's own forward passes.

Every parallel op ends at a barrier that waits for all of the pool's threads. When the machine
has fewer idle cores than threads, a thread that is not scheduled stalls the whole op for a
scheduler time slice, so small ops run several times slower than on one thread (measured: a
[8, 256] forward of the bundled model took 0.23 s on one thread and 0.6-0.9 s on two, with
other processes busy on both cores). Unless the user chose a count (``OMP_NUM_THREADS``, or an
explicit setting), the pool is sized to the cores that are idle when the work starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_elsewhere(samples: int = 5, interval: float = 0.01) -> int:
    """Runnable tasks on the machine right now, other than this one (Linux; else 0): the median
    of a few readings of /proc/loadavg's running count, which changes from moment to moment."""
    readings = []
    for index in range(samples):
        try:
            with open("/proc/loadavg") as handle:
                readings.append(int(handle.read().split()[3].split("/")[0]))
        except (OSError, ValueError, IndexError):
            return 0
        if index + 1 < samples:
            time.sleep(interval)
    return max(0, sorted(readings)[len(readings) // 2] - 1)


def default_threads() -> int | None:
    """The intra-op thread count to use, or None to keep torch's (the user set one)."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return None
    cores = available_cores()
    return max(1, cores - busy_elsewhere())


_PINNED: list[int] = []  # counts held by enclosing ``pinned_threads`` blocks, innermost last


@contextmanager
def pinned_threads(count: int) -> Iterator[None]:
    """Hold torch's intra-op pool at ``count`` threads for the block, whatever a nested
    ``cpu_threads()`` would choose: for two streams of work run side by side in two Python
    threads, each on its own core (the count is process-wide, so neither may change it)."""
    with cpu_threads(count) as effective:  # an enclosing pin wins over ``count``
        _PINNED.append(effective)
        try:
            yield
        finally:
            _PINNED.pop()


@contextmanager
def cpu_threads(count: int | None = None) -> Iterator[int]:
    """Run the block with ``count`` intra-op threads (default: ``default_threads()``, or the count
    an enclosing ``pinned_threads`` holds); restores torch's."""
    import torch

    before = torch.get_num_threads()
    chosen = _PINNED[-1] if _PINNED else count if count is not None else default_threads()
    if chosen is not None and chosen != before:
        torch.set_num_threads(chosen)
    try:
        yield torch.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def on_idle_cores(function: Callable[P, R]) -> Callable[P, R]:
    """Decorator: run ``function`` under ``cpu_threads()`` when torch computes on the CPU."""
    import functools

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        if torch.cuda.is_available():
            return function(*args, **kwargs)
        with cpu_threads():
            return function(*args, **kwargs)

    return wrapper
