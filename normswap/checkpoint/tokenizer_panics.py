"""A tokenizer's Rust code that panics, reported as one line naming its file and regex.

The ``tokenizers`` library turns a Rust panic into ``pyo3_runtime.PanicException``, a
``BaseException`` that ``except Exception`` lets through. A ``tokenizer.json`` can cause one on
purpose: a ``Split`` pre-tokenizer (or a ``Replace`` normalizer) whose regex backtracks without end,
such as ``(a|a)+$``, makes the Oniguruma engine give up (its retry limit bounds the work of each
match) and the library panic; one that backtracks less at every position makes it slow instead.
``held_back`` runs a block that tokenizes with the panic's own lines on stderr held back, and
turns a panic into a ``NormswapError``; ``panic_line`` says which file and which regexes it came
from; ``tokenized`` also bounds a tokenization's time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from normswap.checkpoint.bounded import read_json
from normswap.errors import NormswapError, first_line, quoted, quoted_list

TOKENIZER_FILE = "tokenizer.json"
T = TypeVar("T")


def is_rust_panic(error: BaseException) -> bool:
    """Whether ``error`` is a Rust panic surfaced by pyo3 (``pyo3_runtime.PanicException``)."""
    return type(error).__name__ == "PanicException"


def tokenizer_regexes(folder: Path) -> list[str]:
    """The regexes of ``folder/tokenizer.json``'s pre-tokenizer and normalizer (none when it has
    none or cannot be read)."""

    try:
        data = read_json(folder / TOKENIZER_FILE, walk=False)
    except (NormswapError, OSError):
        return []
    found: list[str] = []
    stack = [data.get(key) for key in ("pre_tokenizer", "normalizer")]
    while stack and len(found) < 100:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("Regex"), str):
                found.append(item["Regex"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def panic_line(error: BaseException, folders: Iterable[Path]) -> str:
    """One line for a Rust panic: for a tokenizer's (the panic came through tokenizing code), the
    tokenizer files among ``folders`` and their regexes."""
    frames, trace = [], error.__traceback__
    while trace is not None and len(frames) < 10_000:
        frames.append(trace.tb_frame.f_code.co_filename)
        trace = trace.tb_next
    if frames and not any("tokeniz" in name for name in frames[-3:]):
        return f"a Rust library failed: {quoted(first_line(error), 160)}"
    files = [Path(folder) / TOKENIZER_FILE for folder in folders if (Path(folder) / TOKENIZER_FILE).is_file()]
    where = []
    for file in files:
        regexes = tokenizer_regexes(file.parent)
        where.append(f"{file}" + (f" (its regex {quoted_list(regexes, 3)})" if regexes else ""))
    source = "; ".join(where) if where else "the checkpoint's tokenizer"
    return (f"the tokenizer of {source} failed inside the Rust tokenizers library: {quoted(first_line(error), 160)}; "
            "a regex that backtracks without end (such as '(a|a)+$') makes it give up")


# A tokenization may take this long in all: a base, plus the text at a rate far below any real
# tokenizer's (they run at millions of characters a second); a regex that backtracks at every
# position runs far slower.
TOKENIZE_SECONDS = 60.0
TOKENIZE_CHARS_PER_SECOND = 20_000


def tokenized(folder: Path | None, call: Callable[[], T], chars: int) -> T:
    """``call()``, a tokenization of ``chars`` characters with ``folder``'s tokenizer, ``held_back``
    and within its deadline. The Rust library lets go of the interpreter while it encodes a batch
    (transformers' fast tokenizers always encode one), so the call runs in a thread that is left
    behind when the deadline passes, and the command ends with one line."""
    limit = TOKENIZE_SECONDS + chars / TOKENIZE_CHARS_PER_SECOND
    result: list = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            result.append(call())
        except BaseException as error:  # handed to the caller's thread, a panic included
            failure.append(error)

    with held_back(folder):
        thread = threading.Thread(target=work, name="normswap-tokenize", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            regexes = tokenizer_regexes(folder) if folder is not None else []
            shown = f" (its regex {quoted_list(regexes, 3)})" if regexes else ""
            raise NormswapError(f"tokenizing {chars:,} characters with {folder / TOKENIZER_FILE if folder else 'the tokenizer'}"
                                f"{shown} took more than {limit:.0f} s; a regex that backtracks at every position "
                                "makes a tokenizer this slow")
        if failure:
            raise failure[0]
    return result[0]


@contextmanager
def held_back(folder: Path | None) -> Iterator[None]:
    """Run a block that tokenizes with ``folder``'s tokenizer: what the Rust code writes on stderr
    (a panic's lines) is held back and written out after the block unless it panicked; a panic
    becomes a ``NormswapError`` naming the file and its regexes."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        held = tempfile.TemporaryFile()
        saved = os.dup(2)
    except OSError:  # no file to hold the lines in: tokenize with stderr as it is
        held = saved = None
    if held is not None:
        os.dup2(held.fileno(), 2)
    panicked = False
    try:
        yield
    except BaseException as error:
        if not is_rust_panic(error):
            raise
        panicked = True
        raise NormswapError(panic_line(error, [folder] if folder is not None else [])) from None
    finally:
        if held is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:
                held.seek(0)
                sys.stderr.write(held.read().decode("utf-8", "replace"))
                sys.stderr.flush()
            held.close()
