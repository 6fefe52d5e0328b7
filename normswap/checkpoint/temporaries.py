"""Temporary output folders, named for the process that fills them, and removal of the ones
whose process is gone (``normswap.checkpoint.output`` explains the lifecycle).

A temporary folder carries ``TMP_MARKER``, a file holding the random token that ends the
folder's name. Clean-up removes only folders whose marker is a regular file with that token: a
user's folder that merely looks like a temporary one by its name is never touched. The one
exception is an empty folder of that exact name (process id, start time, token) whose process is
gone: what a removal killed between the marker and the folder leaves; removing it loses nothing.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from normswap.checkpoint.removal import remove_tree

TMP_TAG = ".normswap-tmp-"
TMP_MARKER = ".normswap-tmp"


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
        token = secrets.token_hex(8)
        tmp = out.with_name(f"{out.name}{TMP_TAG}{pid}-{process_start(pid)}-{token}")
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        with open(tmp / TMP_MARKER, "x", encoding="utf-8") as marker:
            marker.write(token + "\n")
        return tmp


def _marked(path: Path, token: str) -> bool:
    """Whether ``path`` is a real folder (not a link) holding normswap's marker with ``token``."""
    try:
        fd = os.open(path / TMP_MARKER, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.path.islink(path):
            return False
        return os.read(fd, 64).decode("ascii", "replace").strip() == token
    finally:
        os.close(fd)


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
        if _marked(path, parts[2]) and not remove_tree(path, last=TMP_MARKER):
            removed.append(path)
        elif not os.path.islink(path) and _remove_empty(path):
            removed.append(path)  # a removal cut short between the marker and the folder: empty, so nothing is lost
    return removed


def _remove_empty(path: Path) -> bool:
    try:
        os.rmdir(path)
    except OSError:  # not empty, not a folder, or gone
        return False
    return True
