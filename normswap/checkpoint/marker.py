"""The marker normswap writes into every folder it installs: what kind of output it is, and every
path normswap wrote there, so that ``--overwrite`` replaces only folders holding nothing else.

``MARKER`` is a small JSON file: ``written_by``, ``version``, ``kind`` (one of ``KINDS``) and
``paths``, the sorted relative paths of every file and folder normswap wrote (links not
followed). A path under the folder that is not listed was put there by someone else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from normswap import __version__
from normswap.errors import option, quoted

MARKER = ".normswap-output"
KINDS = ("checkpoint", "report", "run")
_MARKER_BYTES = 1 << 20  # a marker lists every path of an output; no normswap output lists more


def _read(folder: Path) -> dict | None:
    """The marker's JSON object; None without a marker (or not a regular file); {} when unreadable."""
    marker = folder / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        with open(marker, "rb") as stream:
            data = json.loads(stream.read(_MARKER_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def marked_kind(folder: Path) -> str | None:
    """The kind recorded in ``folder``'s marker; None when it has no marker, "" when unreadable."""
    data = _read(folder)
    if data is None:
        return None
    kind = data.get("kind")
    return kind if kind in KINDS else ""


def paths_under(folder: Path) -> list[str]:
    """Every file and folder under ``folder`` as a sorted relative path (links listed, not
    followed), the marker itself left out. The walk keeps its own stack, so a tree of any depth
    is listed (``os.walk`` recurses, and a tree deeper than the interpreter's limit stops it);
    a folder that cannot be listed is left out, as ``os.walk`` leaves it."""
    found, pending = [], [""]
    while pending:
        relative = pending.pop()
        try:
            with os.scandir(os.path.join(folder, relative)) as entries:
                for entry in entries:
                    path = os.path.join(relative, entry.name)
                    found.append(path)
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(path)
        except OSError:
            continue
    return sorted(path for path in found if path != MARKER)


def write_marker(folder: Path, kind: str, leave_out: str = "") -> None:
    """Write ``MARKER`` into ``folder``, listing every path now under it but ``leave_out``."""
    paths = [path for path in paths_under(folder) if path != leave_out]
    marker = {"written_by": "normswap", "version": __version__, "kind": kind, "paths": paths}
    (folder / MARKER).write_text(json.dumps(marker) + "\n")


def foreign_paths(folder: Path) -> list[str]:
    """The paths under ``folder`` that its marker does not list: what normswap did not write there
    (every path, when the marker lists none); inside a foreign folder, only the folder is named."""
    data = _read(folder) or {}
    listed = data.get("paths")
    recorded = {path for path in listed if isinstance(path, str)} if isinstance(listed, list) else set()
    foreign: list[str] = []
    for path in paths_under(folder):
        if path not in recorded and not any(path.startswith(outer + os.sep) for outer in foreign[-1:]):
            foreign.append(path)
    return foreign


def describe_foreign(out: Path, paths: list[str]) -> str:
    """The one-line refusal for an ``--out`` holding ``paths`` normswap did not write."""
    shown = ", ".join(quoted(path, 80) for path in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return (f"{option('--out')} {out} holds {shown}{more}, which normswap did not write; {option('--overwrite')} only replaces "
            "what normswap wrote, so move them away or pick another --out")
