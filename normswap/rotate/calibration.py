"""Calibration: the residual stream's second moments on a text, measured block by block.

PCA rotations and slicing need M_n = Σ xᵀx (float64) of the centred stream C·x at the input of
every norm n, summed over every calibration position. The model is not loaded whole for this:
it is built on the meta device and dispatched as layer-by-layer verification dispatches it
(``normswap.runtime.offload.dispatched``), so memory holds one block's weights at a time while
the calibration windows run through it. The statistics are those of the whole model, bit for
bit: the same forward runs, only where the weights come from differs.

A family whose model cannot be dispatched that way (a parameter beside the block list) is
measured on the whole model, and the result says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.checkpoint.bounded import read_text_file
from normswap.checkpoint.source import read_config
from normswap.errors import NormswapError
from normswap.rotate.matrices import Rotation, pca_rotation
from normswap.runtime import offload as layerwise
from normswap.threads import cpu_threads

if TYPE_CHECKING:
    from normswap.rotate.plan import RotationPlan

# windows of at most this many positions
CALIBRATION_WINDOW = 512
# windows of the same length run together, this many at a time
BATCH_WINDOWS = 8


def read_calibration(path: str | Path) -> str:
    return read_text_file(Path(path), "calibration text")


@dataclass
class StreamMoments:
    """Per norm, Σ xᵀx of its centred input (float64, on the CPU), and how it was measured."""

    moments: dict[str, torch.Tensor]
    tokens: int
    window: int
    mode: str  # "blockwise" or "whole"


def calibration_windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """``ids`` (1-D) cut into consecutive windows: [B, window] batches, then the shorter rest."""
    full = ids.numel() // window
    batches = [ids[start * window:(start + min(BATCH_WINDOWS, full - start)) * window].view(-1, window)
               for start in range(0, full, BATCH_WINDOWS)]
    rest = ids[full * window:]
    if rest.numel() >= 2:
        batches.append(rest.unsqueeze(0))
    return batches


@torch.no_grad()
def stream_moments(model: nn.Module, norm_names: list[str], ids: torch.Tensor, window: int,
                   device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Per norm n, M_n = Σ (C·x)ᵀ(C·x) over every position of ``ids``, x the input of n.

    Centring makes the statistic that of the converted model's stream whether ``model`` is the
    original (LayerNorm) or a converted one (whose stream is centred already). The windows run
    on ``device`` (default: the CPU).
    """
    moments: dict[str, torch.Tensor] = {}

    def accumulate(name: str):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            x = x.detach().double().reshape(-1, x.shape[-1])
            x = x - x.mean(-1, keepdim=True)
            product = x.T @ x
            moments[name] = product if name not in moments else moments[name] + product
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(accumulate(name), with_kwargs=True)
               for name in norm_names]
    try:
        for batch in calibration_windows(ids, window):
            model(input_ids=batch.to(device or torch.device("cpu")), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in norm_names if name not in moments]
    if missing:
        raise NormswapError(f"the calibration text never reached the norm {missing[0]}")
    return {name: moments[name].cpu() for name in norm_names}


def empty_source_model(source_dir: Path, architecture: Architecture, config: dict | None = None) -> nn.Module:
    """The source on the meta device: the stock class for an original, normswap's RMSNorm class
    for a normswap conversion (nothing from the checkpoint runs). ``config``: its config.json, if read."""
    config = read_config(source_dir) if config is None else config
    if "normswap" in config:
        return layerwise.converted_model(source_dir, architecture, "rmsnorm", config)
    return layerwise.original_model(source_dir, architecture, config)


def window_for(model: nn.Module, limit: int) -> int:
    from normswap.runtime.reference import context_length

    return min(limit, context_length(model))


def blockwise_moments(source_dir: Path, architecture: Architecture, norm_names: list[str], ids: torch.Tensor,
                      window_limit: int, device: torch.device | None = None,
                      config: dict | None = None) -> StreamMoments:
    """``stream_moments`` with one block's weights in memory at a time, run on ``device`` (default:
    the GPU when there is one); raises ``layerwise.Unsupported`` when the model cannot be
    dispatched block by block."""
    model = empty_source_model(source_dir, architecture, config)
    found = layerwise.find_blocks(model, architecture.blocks)
    if found is None:
        raise layerwise.Unsupported("no list of residual blocks found in the model")
    window = window_for(model, window_limit)
    device = device or layerwise.execution_device()
    with layerwise.dispatched(model, source_dir, found[0], device), cpu_threads(1):
        moments = stream_moments(model, norm_names, ids, window, device)
    del model
    layerwise.release_memory()
    return StreamMoments(moments, int(ids.numel()), window, "blockwise")


def whole_moments(source_dir: Path, architecture: Architecture, norm_names: list[str], ids: torch.Tensor,
                  window_limit: int, config: dict | None = None) -> StreamMoments:
    """``stream_moments`` of the whole source model loaded at once (float32, CPU)."""
    from normswap.runtime.reference import reference_model

    model = reference_model(source_dir, architecture, config=config)
    window = window_for(model, window_limit)
    with cpu_threads(1):
        moments = stream_moments(model, norm_names, ids, window)
    del model
    layerwise.release_memory()
    return StreamMoments(moments, int(ids.numel()), window, "whole")


def calibration_moments(source_dir: Path, architecture: Architecture, norm_names: list[str], ids: torch.Tensor,
                        window_limit: int, config: dict | None = None) -> StreamMoments:
    """Block by block where the model allows it, else on the whole model (``config``: the
    source's config.json, when the caller has read it)."""
    try:
        return blockwise_moments(source_dir, architecture, norm_names, ids, window_limit, config=config)
    except layerwise.Unsupported:
        return whole_moments(source_dir, architecture, norm_names, ids, window_limit, config)


def calibration_ids(source_dir: Path, text: str, label: str, config: dict | None = None) -> torch.Tensor:
    """The calibration text as token ids, with the source's tokenizer."""
    from normswap.runtime.reference import load_tokenizer, tokenize_text

    tokenizer = load_tokenizer(source_dir, config)
    if tokenizer is None:
        raise NormswapError(f"{source_dir} has no tokenizer to read the calibration text with")
    ids = tokenize_text(tokenizer, text)
    if ids.numel() < 2:
        raise NormswapError(f"calibration text {label} gives fewer than 2 tokens")
    return ids


def calibrate(source_dir: Path, rotation_plan: RotationPlan, text_path: str | Path, max_tokens: int,
              config: dict | None = None, make: Callable[[torch.Tensor, dict], Rotation] = pca_rotation) -> Rotation:
    """The pca rotation (``make``: the free form's or the commuting form's) of the source's stream
    on the calibration text: Σ over every norm of its input's second moment, measured block by block."""
    text = read_calibration(text_path)
    ids = calibration_ids(source_dir, text, str(text_path), config)[:max_tokens]
    norms = [norm.name for norm in rotation_plan.plan.norms if norm.baked_into is None and not norm.per_head]
    measured = calibration_moments(source_dir, rotation_plan.architecture, norms, ids, CALIBRATION_WINDOW, config)
    moment = sum(measured.moments[name] for name in norms)
    calibration = {"text": Path(text_path).name, "tokens": int(ids.numel()),
                   "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "window": measured.window}
    return make(moment, calibration)
