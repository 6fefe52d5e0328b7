"""The renames that install a finished output folder at ``--out`` (see ``normswap.checkpoint.output``).

``exchange`` swaps two folders in one ``renameat2(RENAME_EXCHANGE)`` (``--overwrite`` of a
normswap folder). ``move_entries`` fills an empty folder the user made, which is kept (its
inode, owner, mode and ACLs, as ``save_pretrained`` keeps a folder it writes into): each entry
moves with one ``renameat2(RENAME_NOREPLACE)``, so nothing put there meanwhile is replaced, and
the completion marker moves last, so a folder cut short is never taken for a finished output.
On a failure the entries already moved go back, leaving the folder empty again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """``renameat2(source, target, flags)``; False where the system has no such call or flag."""
    libc_name = ctypes.util.find_library("c")
    renameat2 = getattr(ctypes.CDLL(libc_name, use_errno=True), "renameat2", None) if libc_name else None
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, os.strerror(code), str(target))


def exchange(tmp: Path, out: Path) -> None:
    """Swap two folders atomically (Linux ``renameat2``); elsewhere two renames (the caller holds signals)."""
    if _renameat2(tmp, out, _RENAME_EXCHANGE):
        return
    aside = tmp.with_name(tmp.name + "old")
    os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(aside, out)
        raise
    os.rename(aside, tmp)


def _move(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``, never replacing anything already at ``target``."""
    if _renameat2(source, target, _RENAME_NOREPLACE):
        return
    if os.path.lexists(target):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def move_entries(tmp: Path, out: Path, last: str, first: str = "", keep: str = "") -> None:
    """Move every entry of ``tmp`` but ``keep`` into the empty folder ``out``: the entry named
    ``first`` first, the one named ``last`` last."""
    names = sorted((name for name in os.listdir(tmp) if name != keep),
                   key=lambda name: (name != first, name == last, name))
    moved: list[str] = []
    try:
        for name in names:
            _move(tmp / name, out / name)
            moved.append(name)
    except OSError:
        for name in reversed(moved):
            os.rename(out / name, tmp / name)
        raise
