"""Temporary output folders, named for the process that fills them, and removal of the ones
whose process is gone (``normswap.checkpoint.output`` explains the lifecycle)."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

TMP_TAG = ".normswap-tmp-"


def process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot ("0" where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return "0"


def make_temporary(out: Path) -> Path:
    """A fresh folder beside ``out``, named for this process, created with the umask's mode."""
    pid = os.getpid()
    while True:
        tmp = out.with_name(f"{out.name}{TMP_TAG}{pid}-{process_start(pid)}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start == "0" or process_start(pid) in (start, "0")


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove temporary folders for ``out`` whose process is gone; the ones removed."""
    removed = []
    prefix = f"{out.name}{TMP_TAG}"
    try:
        names = os.listdir(out.parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix):].split("-")
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        if _alive(int(parts[0]), parts[1]):
            continue
        path = out.parent / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
