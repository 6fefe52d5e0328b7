"""Removing a folder normswap wrote, without ever leaving its filesystem.

``remove_tree`` walks with directory descriptors (``os.fwalk``-style: every entry is opened
relative to its parent's descriptor with ``O_NOFOLLOW``), so a link is removed as a link and never
followed, and a folder swapped for a link mid-walk is not entered. A folder on another device, or
a mount point (``/proc/self/mountinfo``; a bind mount of the same filesystem keeps its device
number, so the device alone does not tell), is never entered: it and the folders above it are left
in place and returned, for the caller to report. ``mounts_inside`` finds them beforehand, so that
``--overwrite`` can refuse before any work.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def mount_points() -> set[str]:
    """Every mount point of this process's namespace (empty where ``/proc`` is missing)."""
    points = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
            for line in file:
                fields = line.split()
                if len(fields) > 4:  # the kernel writes a space as \040, a backslash as \134
                    points.add(re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4]))
    except OSError:
        pass
    return points


def mounts_inside(root: Path) -> list[Path]:
    """Mount points and folders on another device below ``root`` (links not followed)."""
    real = os.path.realpath(root)
    found = [Path(point) for point in sorted(mount_points()) if point.startswith(real.rstrip("/") + "/")]
    try:
        device = os.lstat(root).st_dev
    except OSError:
        return found
    pending = [Path(root)]  # a stack of its own: a tree of any depth is walked (os.fwalk recurses)
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                folders = [Path(entry.path) for entry in entries if entry.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for path in folders:
            try:
                other_device = os.lstat(path).st_dev != device
            except OSError:
                continue
            if other_device:
                found.append(path)
            else:
                pending.append(path)
    return sorted(set(found))


def remove_tree(root: Path, last: str | None = None) -> list[Path]:
    """Remove ``root`` and everything in it that lies on its filesystem; the paths left in place.

    Nothing is followed: links are unlinked, other devices and mount points are not entered. The
    top-level entry named ``last`` goes last (a marker that must outlive an interrupted removal).
    """
    try:
        device = os.lstat(root).st_dev
    except FileNotFoundError:
        return []
    mounts = {Path(point) for point in mount_points()}
    if Path(os.path.realpath(root)) in mounts:
        return [root]
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return [root]
    try:
        left = _empty(fd, root, device, mounts, Path(os.path.realpath(root)), last)
    except RecursionError:  # a tree deeper than the interpreter's limit: what is left stays
        left = [root]
    finally:
        os.close(fd)
    if left:
        return left
    try:
        os.rmdir(root)
    except OSError:
        return [root]
    return []


def _empty(fd: int, path: Path, device: int, mounts: set[Path], real: Path, last: str | None = None) -> list[Path]:
    """Remove the entries of the open folder ``fd`` (at ``path``), ``last`` last; the ones left in place."""
    left: list[Path] = []
    names = os.listdir(fd)
    if last in names and len(names) > 1:
        names = [name for name in names if name != last] + [last]
    for name in names:
        if name == last and left:
            break  # something stays: so does the marker
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError:
            left.append(path / name)
            continue
        if not stat.S_ISDIR(info.st_mode):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError:
                left.append(path / name)
            continue
        if info.st_dev != device or real / name in mounts:
            left.append(path / name)
            continue
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError:
            left.append(path / name)
            continue
        try:
            same = (os.fstat(child).st_dev, os.fstat(child).st_ino) == (info.st_dev, info.st_ino)
            inner = _empty(child, path / name, device, mounts, real / name) if same else [path / name]
        finally:
            os.close(child)
        if inner:
            left.extend(inner)
            continue
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            left.append(path / name)
    return left
