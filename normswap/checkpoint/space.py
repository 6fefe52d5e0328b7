"""Room for an output, and the progress of writing it."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from normswap.errors import NormswapError, option


def check_free_space(out: Path, needed: int) -> None:
    """Refuse early when the filesystem of ``out`` cannot hold ``needed`` bytes of weights."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    try:
        usage = shutil.disk_usage(existing)
    except OSError:
        return  # no figure to compare with; a full disk is still reported when writing
    if usage.total == 0:
        raise NormswapError(f"{option('--out')} {out} is on a filesystem that stores no files ({existing} is on a "
                            "virtual one, as /proc and /sys are); pick a folder on a disk")
    free = usage.free
    if free < needed:
        raise NormswapError(f"not enough disk space beside --out: the converted weights need {_size(needed)}, "
                            f"{_size(free)} {'is' if free == 1 else 'are'} free; nothing was written")


def _size(count: int) -> str:
    """A byte count for people: 512 bytes, 3.4 kB, 12.0 MB, 1.50 GB."""
    if count < 1000:
        return f"{count} byte{'s' if count != 1 else ''}"
    unit, scale = next((u, s) for u, s in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))
                       if count < s * 1000 or u == "TB")
    return f"{count / scale:.{2 if unit == 'GB' else 1}f} {unit}"


@contextmanager
def progress_bar(total_bytes: int, count: int, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A callback ``done(nbytes)`` per tensor written, drawing bytes and tensors written, rate and
    ETA on stderr (shown after 1 s only); None when ``quiet``. The bar is closed after the block."""
    if quiet:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", delay=1.0,
               leave=False, dynamic_ncols=True)
    written = 0

    def done(nbytes: int) -> None:
        nonlocal written
        written += 1
        bar.set_postfix_str(f"{written}/{count} tensors", refresh=False)
        bar.update(nbytes)

    try:
        yield done
    finally:
        bar.close()
