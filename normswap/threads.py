"""How many CPU threads torch's intra-op pool gets for normswap's own forward passes.

Every parallel op ends at a barrier that waits for all of the pool's threads. When the machine
has fewer idle cores than threads, a thread that is not scheduled stalls the whole op for a
scheduler time slice, so small ops run several times slower than on one thread (measured: a
[8, 256] forward of the bundled model took 0.23 s on one thread and 0.6-0.9 s on two, with
other processes busy on both cores). Unless the user chose a count (``OMP_NUM_THREADS``, or an
explicit setting), the pool is sized to the cores that are idle when the work starts.
"""

from __future__ import annotations

import functools
import os
import threading
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

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import torch

        if torch.cuda.is_available():
            return function(*args, **kwargs)
        with cpu_threads():
            return function(*args, **kwargs)

    return wrapper


# above this many bytes of tensors, two workers share a checkpoint's tensors (one core each)
PARALLEL_BYTES = 256 << 20


def tensor_workers(nbytes: int) -> int:
    """How many threads share the tensors of a checkpoint of ``nbytes`` (``WorkQueue``): two on a
    machine with two idle cores (or the user's thread count, when set) once it is big enough that
    the second thread pays for itself, else one. The load average is read only in that case."""
    if nbytes <= PARALLEL_BYTES:
        return 1
    import torch

    return 2 if (default_threads() or torch.get_num_threads()) >= 2 else 1


class WorkQueue:
    """Items ``0 .. count-1`` taken in order by any number of threads, each on the next one not
    taken, with the outcome of a single pass: the failure reported is the first in item order (a
    thread stops taking items past the first failure found, and every item before it is done by
    someone), whatever the split."""

    def __init__(self, count: int) -> None:

        self.count = count
        self.lock = threading.Lock()  # also guards what the workers record
        self._next, self._stop = 0, count
        self._failures: list[tuple[int, BaseException]] = []

    def take(self) -> int | None:
        """The next item to do, or None when none is left (or one before it failed)."""
        with self.lock:
            index, self._next = self._next, self._next + 1
            return index if index < self.count and index < self._stop else None

    def fail(self, index: int, error: BaseException) -> None:
        with self.lock:
            self._failures.append((index, error))
            self._stop = min(self._stop, index)

    def cancel(self) -> None:
        """Stop every worker at its next item (an interrupt: no outcome is wanted)."""
        with self.lock:
            self._stop = -1

    @property
    def failure(self) -> BaseException | None:
        """The first failure in item order among those found so far."""
        with self.lock:
            return min(self._failures, key=lambda failure: failure[0])[1] if self._failures else None

    def run(self, work: Callable[[WorkQueue], None], workers: int) -> None:
        """``work(self)`` in ``workers`` threads, this one included, one intra-op thread each;
        returns once every one has, then raises the first failure. ``work`` takes items until
        ``take()`` gives None and reports each failure with ``fail``. An interrupt in this thread
        stops the others at their next item, and this thread waits for them before it raises:
        what they write with must not be closed under them."""

        finished = [threading.Event() for _ in range(workers - 1)]

        def worker(done: threading.Event) -> None:
            try:
                work(self)
            finally:
                done.set()

        threads = [threading.Thread(target=worker, args=(done,), name="tensor worker", daemon=True)
                   for done in finished]
        with pinned_threads(1):
            started = 0
            try:
                for thread in threads:
                    thread.start()
                    started += 1
                work(self)
            except BaseException:
                self.cancel()
                raise
            finally:
                self._wait(finished[:started])
        if self.failure is not None:
            raise self.failure

    def _wait(self, finished: list) -> None:
        # each worker's own event, not Thread.join: a join that an interrupt cuts short can mark a
        # thread that is still running as stopped
        interrupted: BaseException | None = None
        for done in finished:
            while not done.is_set():
                try:
                    done.wait()
                except BaseException as error:  # another interrupt while waiting: wait on
                    self.cancel()
                    interrupted = interrupted or error
        if interrupted is not None:
            raise interrupted
