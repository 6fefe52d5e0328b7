"""Verification of a rotated checkpoint against the checkpoint it was rotated from."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.convert.source import read_config, resolve_source
from normswap.modeling import build
from normswap.verify.checkpoint import run_comparison, summarise, tolerance, verification_mode
from normswap.verify.layerwise import centred64
from normswap.verify.loaders import load_converted


def reference_model(path: Path, architecture: Architecture, dtype: torch.dtype = torch.float32,
                    rms_how: str = "rmsnorm") -> nn.Module:
    """The source of a rotation as a model: the stock class for an original, else its RMSNorm form
    (normswap's own classes, or with ``rms_how="remote"`` the checkpoint's own code)."""
    config = read_config(path)
    if "normswap" in config:
        return load_converted(path, rms_how, dtype=dtype)
    return build.load_pretrained(build.model_class(config, architecture.auto_class), path, dtype=dtype)


def verify_rotated(reference: str | Path, rotated: str | Path, *, atol: float | None = None,
                   rtol: float | None = None, layerwise: bool | None = None, quiet: bool = True,
                   trust_remote_code: bool = False) -> dict:
    """Compare a rotated checkpoint with the checkpoint it was rotated from (an original or a
    folded conversion): logits, and per block the stream, which must be C·h·Q.

    The rotated model is built from normswap's own RMSNorm classes; with ``trust_remote_code``
    the checkpoint's ``modeling_normswap.py`` runs instead."""
    from normswap.rotation import family_of, load_rotation

    reference_dir, rotated_dir = resolve_source(reference), Path(rotated)
    reference_config, rotated_config = read_config(reference_dir), read_config(rotated_dir)
    block = rotated_config.get("normswap") or {}
    width = next((rotated_config[key] for key in ("n_embd", "hidden_size", "d_model") if key in rotated_config), None)
    rotation = load_rotation(rotated_dir, width if isinstance(width, int) else None).clone()
    architecture, _, _ = family_of(reference_dir, reference_config)
    atol, rtol = tolerance(block, atol, rtol)
    if (reference_config.get("normswap") or {}).get("stock_loadable", True):
        mode = verification_mode(reference_dir, architecture, layerwise)
    else:
        mode = ("full", "layer by layer needs a reference the stock class loads; compared whole models")

    def stream_map(hidden: torch.Tensor) -> torch.Tensor:
        return centred64(hidden) @ rotation

    rms_how = "remote" if trust_remote_code else "rmsnorm"
    probe, loaders, mode, note = run_comparison(
        reference_dir, rotated_dir, architecture,
        reference=lambda: reference_model(reference_dir, architecture, rms_how=rms_how),
        stock_loadable=False, trust_remote_code=trust_remote_code, layerwise=mode, quiet=quiet,
        stream_map=stream_map, tolerance=(atol, rtol),
    )
    return summarise(probe, loaders, atol=atol, rtol=rtol, mode=mode, note=note, method="exact",
                     paths=(reference_dir, rotated_dir), reference="source")
