"""The core subcommands: convert, inspect, verify.

Command modules import only the standard library at module level: the parser is built, and bad
paths are refused, before torch and transformers are imported.
"""

from __future__ import annotations

from pathlib import Path

from normswap.errors import NormswapError


def check_source(src: str, *, trust_remote_code: bool = False) -> None:
    """Refuse, with one line, a ``src`` that is neither a checkpoint directory nor a hub id.

    A hub id is not fetched here: the command fetches it once, when it needs it.
    """
    from normswap.convert.source import _HUB_ID, EXAMPLE_MODEL, resolve_source

    if src == EXAMPLE_MODEL or Path(src).expanduser().exists() or not _HUB_ID.match(src):
        resolve_source(src, trust_remote_code=trust_remote_code)


def check_device(name: str | None) -> None:
    """Refuse, with one line, a ``--device`` that torch cannot use here."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise NormswapError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NormswapError(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise NormswapError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise NormswapError(f"--device {name}: MPS is not available on this machine")
