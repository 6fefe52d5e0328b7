"""User-facing errors.

Everything a user can cause (bad paths, unsupported models, failed verification) raises
``NormswapError``; the CLI prints its message on one line and exits non-zero, with no traceback.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class NormswapError(Exception):
    """An error caused by the input, reported to the user as one line."""

    exit_code: int = 2


class ArgumentError(NormswapError, ValueError):
    """A bad value of an API argument: a ``ValueError`` to Python callers, one line at the CLI."""


_OPTION_NAMES: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("option_names", default=None)


@contextmanager
def options_named(names: Mapping[str, str]) -> Iterator[None]:
    """Within the block, messages name each command-line option as ``names`` spells it: a Python
    API call names its own arguments (``out``, ``overwrite=True``), not the CLI's flags. The
    outermost caller decides: a command that runs through the API keeps its flags' names
    (the command line enters ``options_named({})`` first)."""
    token = _OPTION_NAMES.set(names if _OPTION_NAMES.get() is None else _OPTION_NAMES.get())
    try:
        yield
    finally:
        _OPTION_NAMES.reset(token)


def option(flag: str) -> str:
    """``flag`` (``--out``) as the current caller spells it (see ``options_named``)."""
    return (_OPTION_NAMES.get() or {}).get(flag, flag)


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def quoted(value: object, limit: int = 120) -> str:
    """An untrusted value as it may appear in a message: ``repr``-escaped (no control character,
    NUL or newline reaches the terminal) and at most ``limit`` characters, the cut marked."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[: limit - 1] + f"…({len(text)} characters)"


def quoted_list(values: list, shown: int = 5) -> str:
    """The first ``shown`` of ``values``, each ``quoted``, and how many more there are."""
    text = ", ".join(quoted(value, 60) for value in values[:shown])
    return text + (f" and {len(values) - shown} more" if len(values) > shown else "")


MESSAGE_CHARS = 2000  # no message line is longer, whatever it quotes


def one_line(text: str) -> str:
    """A message as the command line prints it: one line, whitespace runs as one space, any other
    control character escaped, at most ``MESSAGE_CHARS`` characters (the cut marked)."""
    text = " ".join(text.split())
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


class VerificationError(NormswapError):
    """The converted model did not match the original within tolerance."""

    exit_code = 3
