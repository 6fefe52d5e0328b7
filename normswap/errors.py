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


class VerificationError(NormswapError):
    """The converted model did not match the original within tolerance."""

    exit_code = 3
