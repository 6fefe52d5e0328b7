"""Verification of a rotated checkpoint against the checkpoint it was rotated from."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.convert.source import read_config, resolve_source
from normswap.errors import NormswapError
from normswap.modeling import build
from normswap.verify import compare as verify
from normswap.verify import layerwise as verify_layerwise


def reference_model(path: Path, architecture: Architecture, dtype: torch.dtype = torch.float32,
                    rms_how: str = "rmsnorm") -> nn.Module:
    """The source of a rotation as a model: the stock class for an original, else its RMSNorm form
    (normswap's own classes, or with ``rms_how="remote"`` the checkpoint's own code)."""
    from normswap.verify.checkpoint import load_converted

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
    rms_how = "remote" if trust_remote_code else "rmsnorm"
    from normswap.dtypes import parse_dtype
    from normswap.rotation import family_of as _family
    from normswap.rotation import load_rotation
    from normswap.verify.checkpoint import _stock_refuses, _verification_mode, load_converted

    reference_dir = resolve_source(reference)
    rotated_dir = Path(rotated)
    reference_config = read_config(reference_dir)
    block = read_config(rotated_dir).get("normswap") or {}
    rotated_config = read_config(rotated_dir)
    width = next((rotated_config[key] for key in ("n_embd", "hidden_size", "d_model") if key in rotated_config), None)
    matrix = load_rotation(rotated_dir, width if isinstance(width, int) else None)
    architecture, _, _ = _family(reference_dir, reference_config)
    checkpoint_dtype = parse_dtype(block.get("options", {}).get("dtype")) or torch.float32
    default_atol, default_rtol = verify.default_tolerance(checkpoint_dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol

    stock_reference = (reference_config.get("normswap") or {}).get("stock_loadable", True)
    if stock_reference:
        mode, note = _verification_mode(reference_dir, architecture, layerwise)
    else:
        mode, note = "full", "layer by layer needs a reference the stock class loads; compared whole models"
    loaders: dict[str, dict] = {"stock": {"refused": _stock_refuses(rotated_dir, architecture)}}
    probe = None
    if mode == "layerwise":
        rotation = matrix.clone()

        def stream_map(hidden: torch.Tensor) -> torch.Tensor:
            hidden = hidden.double()
            return (hidden - hidden.mean(-1, keepdim=True)) @ rotation

        try:
            probe, compared = verify_layerwise.compare_layerwise(
                reference_dir, rotated_dir, architecture, stock_loadable=False, quiet=quiet, stream_map=stream_map,
                rms_how=rms_how,
            )
        except verify_layerwise.Unsupported as error:
            mode, note = "full", f"layer by layer unavailable ({error}); compared whole models"
        else:
            for figures in compared.values():
                figures["passed"] = verify.within_tolerance(figures, atol, rtol)
            loaders.update(compared)
    if probe is None:
        model = reference_model(reference_dir, architecture, rms_how=rms_how)
        probe = verify.PROBES[architecture.probe](model.config, verify.load_tokenizer(reference_dir))
        expected = verify.model_output(model, probe, architecture.probe)
        del model
        gc.collect()
        model = load_converted(rotated_dir, rms_how)
        if any(isinstance(module, nn.LayerNorm) for module in model.modules()):
            raise NormswapError("the RMSNorm model still has nn.LayerNorm modules")
        candidate = verify.model_output(model, probe, architecture.probe)
        del model
        gc.collect()
        figures = verify.compare_outputs(expected, candidate, distribution=True, labels=probe.inputs.get("input_ids"))
        figures["passed"] = verify.within_tolerance(figures, atol, rtol)
        loaders["remote_code"] = figures
    compared = [figures for figures in loaders.values() if "max_abs_diff" in figures]
    limit = atol + rtol * max(figures["max_abs_reference"] for figures in compared)
    passed = all(figures["passed"] for figures in compared) and all(
        figures.get("refused", True) for figures in loaders.values()
    )
    result = {
        "probe": probe.kind,
        "probe_shape": list(next(iter(probe.inputs.values())).shape),
        "compute_dtype": "float32",
        "method": "exact",
        "reference": "source",
        "tolerance": {"atol": atol, "rtol": rtol, "limit": limit},
        "loaders": loaders,
        "passed": passed,
        "mode": mode,
        **({"note": note} if note else {}),
    }
    if mode == "layerwise":
        result["worst_layer"] = {"loader": "remote_code", **loaders["remote_code"]["worst_layer"]}
    return result
