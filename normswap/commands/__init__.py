"""The core subcommands: convert, inspect, verify.

Command modules import only the standard library at module level: the parser is built, and bad
paths are refused, before torch and transformers are imported.
"""

from __future__ import annotations

from pathlib import Path


def check_source(src: str, *, trust_remote_code: bool = False) -> None:
    """Refuse, with one line, a ``src`` that is neither a checkpoint directory nor a hub id.

    A hub id is not fetched here: the command fetches it once, when it needs it.
    """
    from normswap.source import _HUB_ID, EXAMPLE_MODEL, resolve_source

    if src == EXAMPLE_MODEL or Path(src).expanduser().exists() or not _HUB_ID.match(src):
        resolve_source(src, trust_remote_code=trust_remote_code)
