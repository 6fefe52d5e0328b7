"""``Comparison``: what one forward comparison of a checkpoint with its reference runs.

Both ways of comparing take it: whole models (``whole``) and block by block (``layerwise``);
``checkpoint.run_comparison`` picks between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.verify.compare import centred

StreamMap = Callable[[torch.Tensor], torch.Tensor]  # the original's stream -> the converted model's


def centred64(x: torch.Tensor) -> torch.Tensor:
    """C·x in float64: the stream the converted model carries, for the original's stream x."""
    return centred(x.double())


@dataclass(frozen=True)
class Comparison:
    """The checkpoint at ``converted_dir`` against the one at ``reference_dir`` (of the family
    ``architecture``), on one probe.

    ``reference`` builds the reference model for a whole-model comparison. ``configs``: the two
    config.json files, when the caller has read them. ``stock_loadable``: stock transformers' class
    must load the checkpoint (else it must refuse it); ``rms_how``: how the RMSNorm class loads
    it (``rmsnorm``, ``remote``; None: not at all, for an uncentred stream). ``mode``: a
    ``verification_mode`` answer, (``full`` or ``layerwise``, note). ``stream_map`` turns the
    reference's stream into the one the checkpoint must carry. With ``tolerance`` (atol, rtol), a
    block-by-block run teacher-forces only the loads that fail it. Outputs in ``skip`` are not
    compared. Without ``every_block`` a block-by-block run runs the sampled blocks only (for a
    checkpoint whose weights the proof covers)."""

    reference_dir: Path
    converted_dir: Path
    architecture: Architecture
    reference: Callable[[], nn.Module] | None = None
    configs: tuple[dict | None, dict | None] = (None, None)
    stock_loadable: bool = True
    rms_how: str | None = "rmsnorm"
    mode: tuple[str, str | None] = ("full", None)
    quiet: bool = True
    stream_map: StreamMap = centred64
    tolerance: tuple[float, float] | None = None
    skip: frozenset[str] = frozenset()
    every_block: bool = True
