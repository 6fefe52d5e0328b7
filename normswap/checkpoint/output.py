"""Output folders: claimed before any work, written beside, installed atomically, never lost.

Every command that writes a folder (``convert``, ``run``) goes through ``claimed_output``:

1. ``--out`` is checked: not a symbolic link, not a file, not the current directory or above it,
   not containing and not inside any input; a non-empty folder is replaced only with
   ``--overwrite`` and only when it carries ``MARKER``, the file normswap writes into every
   folder it installs, recording the same kind (``checkpoint``, ``report``, ``run``): a report
   never replaces a checkpoint. The marker lists every path normswap wrote (``marker``); a folder
   holding any other path is never replaced. A folder holding a mount point or another filesystem is never
   replaced (its removal would reach into what is mounted there).
2. ``--out`` is claimed: created when absent (so no one else can create it meanwhile) and locked
   with ``flock``, so of two commands writing one ``--out`` the second fails at once.
3. The work is written into a temporary folder beside ``--out`` whose name carries the owning
   process id and start time (``<out>.normswap-tmp-<pid>-<start>-<token>``) and which holds
   ``temporaries.TMP_MARKER`` with the same token. A later command for the same ``--out`` removes
   such folders whose process is gone, and says so; a folder without the marker is never removed.
4. Install: the temporary folder is renamed onto the claimed empty folder this command created
   (the rename fails, and nothing is replaced, if anything was put into it meanwhile); an empty
   folder that was there already is kept, with its mode and owner, and filled entry by entry,
   the marker last (``renames.move_entries``); or the temporary folder is swapped with the old
   normswap folder in one ``renameat2(RENAME_EXCHANGE)`` under ``--overwrite``. A folder that
   was replaced at ``--out`` while the command ran is never touched. The old folder is removed
   by ``removal.remove_tree``, which never follows a link or leaves its filesystem; what it
   cannot remove safely is left in place and named. ``installed`` lists the outputs this
   process has installed, so that an interrupt arriving afterwards can say they are complete.

   Before the first rename the temporary folder gets ``journal.JOURNAL``, which lists what the
   install puts into ``--out`` and is removed last, once all of it is in place; the temporary
   marker stays in the temporary folder until then too (after an exchange it marks the old folder
   set aside), so every state an install passes through is recognisable.

On any failure or interrupt (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1), the temporary folder, a
claimed ``--out`` that is still empty and the parent folders this command created are removed.
Only SIGKILL (or a power cut) can leave anything behind: a temporary folder (removed by the next
command for that ``--out``, which says so), an empty ``--out`` (reused), or an ``--out`` holding
the journal of an install cut short, which the next command finishes when everything is in place
or else takes back, leaving the user's folder empty again (``journal.repair``), before it checks
``--out``. Files get the process's umask, as ``save_pretrained``'s do.
Before any of this, ``check_free_space`` refuses a filesystem too small for the weights, and
``progress_bar`` reports the writing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from normswap.checkpoint.files import check_utf8_path
from normswap.checkpoint.journal import JOURNAL, read_journal, repair, write_journal
from normswap.checkpoint.marker import KINDS as KINDS  # re-exported
from normswap.checkpoint.marker import MARKER, describe_foreign, foreign_paths, marked_kind, write_marker
from normswap.checkpoint.removal import mount_points, mounts_inside, remove_tree
from normswap.checkpoint.renames import exchange, move_entries
from normswap.checkpoint.space import check_free_space as check_free_space  # re-exported
from normswap.checkpoint.space import progress_bar as progress_bar  # re-exported
from normswap.checkpoint.temporaries import TMP_MARKER, make_temporary, remove_stale_temporaries
from normswap.errors import NormswapError, option

installed: list[Path] = []  # every outermost --out this process installed (not one nested in another's work)
_open_claims: list[Path] = []


def absolute(out: str | Path) -> Path:
    """``out`` as an absolute path, symbolic links kept (``--out .`` becomes the current folder)."""
    path = Path(os.path.abspath(os.path.expanduser(str(out))))
    if not path.name:
        raise NormswapError(f"{option('--out')} {out} is the filesystem root; name a folder")
    return path


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_out(out: Path, inputs: Sequence[Path], overwrite: bool, *, kind: str) -> None:
    """Refuse an ``--out`` that normswap may not write (see the module docstring); no side effects."""
    if out.is_symlink():
        raise NormswapError(f"{option('--out')} {out} is a symbolic link; pass the folder itself")
    if kind == "checkpoint":
        check_utf8_path(out, option("--out"))
    real = _real(out)
    for item in inputs:
        source = _real(Path(item))
        if source == real:
            raise NormswapError(f"{option('--out')} {out} is the input {item}; refusing to write over an input")
        if _within(source, real):
            raise NormswapError(f"{option('--out')} {out} contains the input {item}; refusing to write over an input")
        if _within(real, source):
            raise NormswapError(f"{option('--out')} {out} lies inside the input {item}; refusing to write into an input")
    if _within(_real(Path.cwd()), real):
        raise NormswapError(f"{option('--out')} {out} is or contains the current folder; pass another folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise NormswapError(f"{option('--out')} {out} exists and is not a folder")
    if os.path.realpath(out) in mount_points():
        raise NormswapError(f"{option('--out')} {out} is a mount point, which cannot be replaced by renaming a folder onto it "
                            "(as normswap installs); pass a folder inside it")
    try:
        empty = not any(out.iterdir())
    except OSError as error:
        raise NormswapError(f"cannot read --out {out}: {error.strerror}") from None
    if empty or read_journal(out) is not None:
        return  # an install cut short is repaired once --out is claimed, and checked again
    if not overwrite:
        raise NormswapError(f"{option('--out')} {out} exists and is not empty; pass {option('--overwrite')} to replace a folder normswap wrote")
    found = marked_kind(out)
    if found is None:
        raise NormswapError(
            f"{option('--out')} {out} was not written by normswap (it has no {MARKER}); {option('--overwrite')} only replaces "
            "folders normswap wrote, so remove or rename it yourself"
        )
    if found != kind:
        raise NormswapError(f"{option('--out')} {out} holds a normswap {found or 'output of unknown kind'}, not a {kind}; "
                            f"{option('--overwrite')} only replaces a folder of the same kind, so pick another {option('--out')}")
    mounts = mounts_inside(out)
    if mounts:
        raise NormswapError(f"{option('--out')} {out} holds {mounts[0]}, a mount point or another filesystem; normswap never "
                            "removes across filesystems, so unmount it or pick another --out")
    foreign = foreign_paths(out)
    if foreign:
        raise NormswapError(describe_foreign(out, foreign))


class Claim:
    """A claimed ``--out`` and the temporary folder to fill; ``install`` puts it in place."""

    def __init__(self, out: Path, tmp: Path, fd: int, kind: str, log: Callable[[str], None]) -> None:
        self.log = log
        self.out = out
        self.tmp = tmp
        self.kind = kind
        self._fd = fd
        self.installed = False
        self.made_out = False  # whether this command created --out (else it was an empty folder already)

    def install(self) -> None:
        """Write the marker and the journal, and move the temporary folder to ``--out`` (see the
        module docstring); the journal goes last, once everything is in place."""
        write_marker(self.tmp, self.kind, leave_out=TMP_MARKER)
        write_journal(self.tmp, self.out)
        with _signals_held(_is_main_thread()):
            if not _same_folder(self._fd, self.out):
                raise NormswapError(f"{option('--out')} {self.out} was replaced by something else while normswap worked; "
                                    "left it as it is, nothing was written")
            if any(self.out.iterdir()):
                if marked_kind(self.out) != self.kind or mounts_inside(self.out) or foreign_paths(self.out):
                    raise NormswapError(f"something was written into --out {self.out} while normswap worked; "
                                        "left it as it is, nothing was written")
                exchange(self.tmp, self.out)  # the old folder is now at self.tmp, removed below
                # the old folder takes the temporary marker, so that a kill from here on leaves it removable
                os.rename(self.out / TMP_MARKER, self.tmp / TMP_MARKER)
            else:
                try:
                    if self.made_out:
                        os.rename(self.tmp, self.out)
                        os.unlink(self.out / TMP_MARKER)
                    else:  # the user's own folder: kept, filled entry by entry, the journal first
                        move_entries(self.tmp, self.out, first=JOURNAL, last=MARKER, keep=TMP_MARKER)
                except OSError as error:
                    if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                        raise NormswapError(f"something was written into --out {self.out} while normswap "
                                            "worked; left it as it is, nothing was written") from None
                    raise
            os.unlink(self.out / JOURNAL)  # the install is complete
            self.installed = True
            if _open_claims and _open_claims[0] == self.out:
                installed.append(self.out)
        left = remove_tree(self.tmp, last=TMP_MARKER)
        for path in left:
            self.log(f"left {path} in place: it cannot be removed safely (another filesystem, a mount point, or denied)")


@contextmanager
def claimed_output(out: Path, *, inputs: Sequence[Path], overwrite: bool, kind: str,
                   log: Callable[[str], None] | None = None) -> Iterator[Claim]:
    """Claim ``out`` and yield a ``Claim`` whose ``tmp`` folder the caller fills and installs.

    Any exception inside leaves nothing behind (see the module docstring); ``OSError`` becomes a
    one-line ``NormswapError``. SIGTERM is turned into ``KeyboardInterrupt`` so that cleanup runs.
    """
    log = log or (lambda message: print(f"normswap: {message}", file=sys.stderr))
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    try:
        check_out(out, inputs, overwrite, kind=kind)
    except NormswapError:
        # a refusal is one line: the temporary folders of a dead process are removed without a word
        with suppress(OSError):
            remove_stale_temporaries(out)
        raise
    created: list[Path] = []
    fd = -1
    claim: Claim | None = None
    previous = signal.getsignal(signal.SIGTERM)
    in_main_thread = _is_main_thread()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    if in_main_thread:
        signal.signal(signal.SIGTERM, on_term)
    _open_claims.append(out)
    try:
        with _output_errors(out):
            # each folder is recorded as it is made, with interrupts held, so clean-up knows them all
            with _signals_held(in_main_thread):
                created = _make_parents(out.parent)
            for stale in remove_stale_temporaries(out):
                log(f"removed {stale}, left by a normswap process that no longer runs")
            with _signals_held(in_main_thread):
                try:
                    os.mkdir(out)
                    created.append(out)
                except FileExistsError:
                    pass
                fd = _lock(out)
                repaired = repair(out)  # an install cut short: its owner no longer holds the lock
                if repaired:
                    log(repaired)
                    for stale in remove_stale_temporaries(out):
                        log(f"removed {stale}, left by a normswap process that no longer runs")
                check_out(out, inputs, overwrite, kind=kind)  # again, now that nobody else can write here
                claim = Claim(out, make_temporary(out), fd, kind, log)
                claim.made_out = out in created
            yield claim
    finally:
        with _signals_held(in_main_thread):
            if claim is not None and not claim.installed:
                for path in remove_tree(claim.tmp):
                    log(f"left {path} in place: it cannot be removed safely (another filesystem, a mount point, "
                        "or denied)")
            if claim is None or not claim.installed:
                for folder in reversed(created):
                    if folder != out or fd < 0 or _same_folder(fd, out):
                        _remove_if_empty(folder)
            if fd >= 0:
                os.close(fd)
            _open_claims.remove(out)
            if in_main_thread:
                signal.signal(signal.SIGTERM, previous)


@contextmanager
def _output_errors(out: Path) -> Iterator[None]:
    """Turn an ``OSError`` (full disk, read-only filesystem, name too long, busy, denied, ...)
    into one line naming the file and the reason."""
    try:
        yield
    except OSError as error:
        raise NormswapError(describe_os_error(error, f"while writing --out {out}")) from None


def describe_os_error(error: OSError, context: str) -> str:
    """One line for an ``OSError``: the reason, the file, what was being done, and the outcome."""
    reason = error.strerror or type(error).__name__
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on the device"
    where = f" ({error.filename})" if error.filename else ""
    return f"{reason}{where} {context}; nothing was written"


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and its missing ancestors; the ones created, outermost first."""
    missing = []
    folder = parent
    while not folder.exists() and not folder.is_symlink():
        missing.append(folder)
        folder = folder.parent
    created = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder)
        except FileExistsError:
            continue
        except OSError:
            for made in reversed(created):
                _remove_if_empty(made)
            raise
        created.append(folder)
    if not parent.is_dir():
        raise NormswapError(f"{option('--out')} cannot be created in {parent}: it is not a folder")
    return created


def _remove_if_empty(folder: Path) -> None:
    with suppress(OSError):  # not empty (or gone): left as it is
        os.rmdir(folder)


def _lock(out: Path) -> int:
    """An open, exclusively locked descriptor of the folder ``out`` (refuses a second claimant)."""
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NormswapError(f"{option('--out')} {out} is not a folder") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NormswapError(f"another normswap process is writing --out {out}; wait for it or pick another --out") from None
    except OSError:
        os.close(fd)
        raise
    if not _same_folder(fd, out):
        os.close(fd)
        raise NormswapError(f"{option('--out')} {out} changed while normswap claimed it; try again")
    return fd


def _same_folder(fd: int, path: Path) -> bool:
    try:
        here = os.lstat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


@contextmanager
def _signals_held(enabled: bool = True) -> Iterator[None]:
    """Defer the interrupts (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1) until the block is done (they
    are delivered afterwards)."""
    held = {signal.SIGINT, signal.SIGTERM, *(getattr(signal, name) for name in ("SIGHUP", "SIGQUIT", "SIGUSR1")
                                             if hasattr(signal, name))}
    if not enabled:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
