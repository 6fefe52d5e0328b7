"""The install journal: how an install cut short by SIGKILL (or a power cut) is recognised and
repaired by the next command for the same ``--out`` (``normswap.checkpoint.output`` explains the
install).

Before an install's first rename, ``JOURNAL`` is written into the temporary folder: the name of
that folder and the top-level names the install puts into ``--out``. It travels with the entries
(the folder is renamed or exchanged whole) or is moved into ``--out`` first (a user's empty
folder, filled entry by entry), and it is the last thing the install removes. So whenever a
killed install has touched ``--out``, ``--out`` holds the journal; and an ``--out`` holding one
whose owner no longer holds the lock on ``--out`` was cut short. ``repair`` then finishes it, when
every listed name and the completion marker are in place (only the journal and the temporary
marker are left to remove), or else takes back every listed name, leaving the folder as the user
had it: empty. The temporary folder left beside is removed as every stale one is.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from normswap.checkpoint.marker import MARKER
from normswap.checkpoint.removal import remove_tree
from normswap.checkpoint.temporaries import TMP_MARKER, TMP_TAG

JOURNAL = ".normswap-installing"
_JOURNAL_BYTES = 1 << 20


def write_journal(tmp: Path, out: Path) -> None:
    """Record in ``tmp`` what installing it at ``out`` puts there (every top-level entry of ``tmp``
    but its temporary marker)."""
    names = sorted(name for name in os.listdir(tmp) if name not in (TMP_MARKER, JOURNAL))
    with open(tmp / JOURNAL, "x", encoding="utf-8") as handle:
        handle.write(json.dumps({"tmp": tmp.name, "out": out.name, "names": names}) + "\n")


def read_journal(out: Path) -> dict | None:
    """``out``'s journal when it holds a valid one (a regular file naming a temporary folder of
    ``out`` and plain names), else None."""
    try:
        fd = os.open(out / JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, _JOURNAL_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return None
    tmp, names = data.get("tmp"), data.get("names")
    if not (isinstance(tmp, str) and tmp.startswith(out.name + TMP_TAG) and _plain(tmp)):
        return None
    if not (isinstance(names, list) and all(isinstance(name, str) and _plain(name) for name in names)):
        return None
    return data


def repair(out: Path) -> str | None:
    """Finish or take back an install into ``out`` that was cut short (the caller holds ``out``'s
    lock, so its owner is gone); what was done, in words, or None when there was nothing to do."""
    data = read_journal(out)
    if data is None:
        return None
    names = data["names"]
    marker = out / TMP_MARKER
    if MARKER in names and all(os.path.lexists(out / name) for name in names):
        tmp = out.parent / data["tmp"]
        if os.path.lexists(marker):
            if tmp.is_dir() and not tmp.is_symlink() and not os.path.lexists(tmp / TMP_MARKER):
                os.rename(marker, tmp / TMP_MARKER)  # the old output set aside: marked, so it is removed
            else:
                os.unlink(marker)
        os.unlink(out / JOURNAL)
        return f"finished installing {out}, cut short by a normswap process that no longer runs"
    for name in names:
        path = out / name
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    if os.path.lexists(marker):
        os.unlink(marker)
    os.unlink(out / JOURNAL)
    return f"took back the part of an install into {out} that a normswap process no longer running left"


def _plain(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name
