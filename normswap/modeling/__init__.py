"""Model classes.

- ``build``: the transformers class for a config, built on meta.
- ``remote``: the RMSNorm classes, shipped inside outputs as ``modeling_normswap.py``.
- ``registry``: the ``normswap_<type>`` model types registered with the Auto classes.
- ``hadamard``: Hadamard matrices of every order normswap builds.
- ``online``: the online Hadamard record, and its check on every load.
"""

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
