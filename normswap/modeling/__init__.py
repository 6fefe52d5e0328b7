"""Model classes: ``build`` (transformers classes for a config, on meta) and ``remote`` (the
RMSNorm classes, shipped inside every checkpoint as ``modeling_normswap.py``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

MODELING_FILE = "modeling_normswap.py"


def modeling_source() -> bytes:
    """The bytes of ``modeling_normswap.py`` as this normswap writes it (``remote.py``, verbatim)."""
    return (Path(__file__).parent / "remote.py").read_bytes()


def modeling_sha256() -> str:
    """The hash provenance records, so that verify can refuse a changed modeling file."""
    return hashlib.sha256(modeling_source()).hexdigest()
