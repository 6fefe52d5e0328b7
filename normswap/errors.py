"""User-facing errors.

Everything a user can cause (bad paths, unsupported models, failed verification) raises
``NormswapError``; the CLI prints its message on one line and exits non-zero, with no traceback.
"""

from __future__ import annotations


class NormswapError(Exception):
    """An error caused by the input, reported to the user as one line."""

    exit_code: int = 2


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def quoted(value: object, limit: int = 120) -> str:
    """An untrusted value as it may appear in a message: ``repr``-escaped (no control character,
    NUL or newline reaches the terminal) and at most ``limit`` characters, the cut marked."""
    text = repr(value if isinstance(value, str) else str(value))
    if len(text) <= limit:
        return text
    return text[: limit - 1] + f"…({len(text)} characters)"


class VerificationError(NormswapError):
    """The converted model did not match the original within tolerance."""

    exit_code = 3
