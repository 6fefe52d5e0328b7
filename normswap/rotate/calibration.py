"""Calibration: the residual stream's second moments on inputs of the model's kind, block by block.

PCA rotations and slicing need M_n = Σ xᵀx (float64) of the centred stream C·x at the input of
every norm n of the rotated stream, summed over every calibration position. The inputs are what
the family reads: text for a causal language model and CLIP's text tower (cut into windows of the
context length); for Whisper the transcripts' tokens through the decoder with the encoder run on
their audio's log-mel features, for ViT images as pixel values (``CalibrationInputs``, read above
this layer, from media files, by a ``MediaCalibration`` the caller passes down). The model is not loaded whole for this:
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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from normswap.architectures import ARCHITECTURES, Architecture
from normswap.checkpoint.bounded import read_text_file
from normswap.checkpoint.provenance import original_model_type
from normswap.checkpoint.source import read_config
from normswap.errors import NormswapError
from normswap.rotate.matrices import Rotation, pca_rotation
from normswap.rotate.plan import in_fixed_stream
from normswap.runtime import offload as layerwise
from normswap.runtime.reference import config_context_length, load_tokenizer, reference_model, tokenize_text
from normswap.threads import cpu_threads

if TYPE_CHECKING:
    from normswap.rotate.plan import RotationPlan

# windows of at most this many positions
CALIBRATION_WINDOW = 512
# windows of the same length run together, this many at a time
BATCH_WINDOWS = 8


# a calibration token spans at most this many characters of text (the tokenizer reads a bounded prefix)
CHARS_PER_TOKEN = 32


def read_calibration(path: str | Path, max_tokens: int | None = None) -> str:
    """The calibration text; with ``max_tokens``, only the prefix that many tokens can span."""
    return read_text_file(Path(path), "calibration text",
                          max_chars=None if max_tokens is None else max_tokens * CHARS_PER_TOKEN)


@dataclass
class CalibrationInputs:
    """The batches a calibration runs (keyword arguments of the model's forward), the stream
    positions they give, and the provenance record of what they were made from."""

    batches: list[dict[str, torch.Tensor]]
    tokens: int
    record: dict


@runtime_checkable
class MediaCalibration(Protocol):
    """Reads calibration inputs of a model that does not read text (audio, images)."""

    def resolve(self, config: dict, spec: str) -> str:
        """``spec`` checked for the model of ``config`` (one-line refusal), resolved ("bundled")."""

    def inputs(self, source_dir: Path, config: dict, spec: str, max_tokens: int) -> CalibrationInputs:
        """The model inputs made from ``spec``, at most about ``max_tokens`` stream positions."""


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


def reads_text(architecture: Architecture, config: dict) -> bool:
    """Whether the rotated stream of a checkpoint of ``config`` is calibrated on text."""
    return architecture.calibration_modality(str(original_model_type(config))) == "text"


def run_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """One calibration forward: the rotated tower alone where the family's record names one
    (``calibration_tower``: CLIPModel's text tower), without a cache for the generating classes."""
    model_type = str(getattr(model.config, "model_type", "")).removeprefix("normswap_")
    architecture = ARCHITECTURES.get(model_type)
    tower = architecture.calibration_tower.get(model_type) if architecture is not None else None
    if tower is not None:
        model.get_submodule(tower)(**batch)
    elif "pixel_values" in batch:
        model(**batch)
    else:
        model(**batch, use_cache=False)


@torch.no_grad()
def stream_moments(model: nn.Module, norm_names: list[str], batches: list[dict[str, torch.Tensor]],
                   device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Per norm n, M_n = Σ (C·x)ᵀ(C·x) over every position of every batch, x the input of n.

    Centring makes the statistic that of the converted model's stream whether ``model`` is the
    original (LayerNorm) or a converted one (whose stream is centred already), and it leaves the
    complement of 1, where the commuting form's pca works, as it is. The batches run on
    ``device`` (default: the CPU).
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
        for batch in batches:
            run_forward(model, {key: value.to(device or torch.device("cpu")) for key, value in batch.items()})
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in norm_names if name not in moments]
    if missing:
        raise NormswapError(f"the calibration inputs never reached the norm {missing[0]}")
    return {name: moments[name].cpu() for name in norm_names}


def empty_source_model(source_dir: Path, architecture: Architecture, config: dict | None = None) -> nn.Module:
    """The source on the meta device: the stock class for an original, normswap's RMSNorm class
    for a normswap conversion (nothing from the checkpoint runs). ``config``: its config.json, if read."""
    config = read_config(source_dir) if config is None else config
    if "normswap" in config:
        return layerwise.converted_model(source_dir, architecture, "rmsnorm", config)
    return layerwise.original_model(source_dir, architecture, config)


def window_for(model: nn.Module, limit: int) -> int:
    """The calibration window: ``limit``, or the (text tower's) context length where shorter."""

    text = getattr(model.config, "text_config", None) or model.config
    return min(limit, config_context_length(text.to_dict()) or 1024)


def model_batches(model: nn.Module, inputs: torch.Tensor | CalibrationInputs,
                  window_limit: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The batches and window of ``inputs``: token ids cut into windows, or media batches as read."""
    if isinstance(inputs, CalibrationInputs):
        return inputs.batches, 0
    window = window_for(model, window_limit)
    return [{"input_ids": batch} for batch in calibration_windows(inputs, window)], window


def blockwise_moments(source_dir: Path, architecture: Architecture, norm_names: list[str],
                      ids: torch.Tensor | CalibrationInputs, window_limit: int, device: torch.device | None = None,
                      config: dict | None = None) -> StreamMoments:
    """``stream_moments`` with one block's weights in memory at a time, run on ``device`` (default:
    the GPU when there is one); raises ``layerwise.Unsupported`` when the model cannot be
    dispatched block by block."""
    model = empty_source_model(source_dir, architecture, config)
    found = layerwise.find_blocks(model, architecture.blocks)
    if found is None:
        raise layerwise.Unsupported("no list of residual blocks found in the model")
    layerwise.device_map_for(model, found[0])  # Unsupported (a parameter beside the blocks) before any read
    batches, window = model_batches(model, ids, window_limit)
    device = device or layerwise.execution_device()
    with layerwise.dispatched(model, source_dir, found[0], device), cpu_threads(1):
        moments = stream_moments(model, norm_names, batches, device)
    del model
    layerwise.release_memory()
    return StreamMoments(moments, positions(ids), window, "blockwise")


def positions(inputs: torch.Tensor | CalibrationInputs) -> int:
    return inputs.tokens if isinstance(inputs, CalibrationInputs) else int(inputs.numel())


def whole_moments(source_dir: Path, architecture: Architecture, norm_names: list[str],
                  ids: torch.Tensor | CalibrationInputs, window_limit: int, config: dict | None = None) -> StreamMoments:
    """``stream_moments`` of the whole source model loaded at once (float32, CPU)."""

    model = reference_model(source_dir, architecture, config=config)
    batches, window = model_batches(model, ids, window_limit)
    with cpu_threads(1):
        moments = stream_moments(model, norm_names, batches)
    del model
    layerwise.release_memory()
    return StreamMoments(moments, positions(ids), window, "whole")


def calibration_moments(source_dir: Path, architecture: Architecture, norm_names: list[str],
                        ids: torch.Tensor | CalibrationInputs, window_limit: int,
                        config: dict | None = None) -> StreamMoments:
    """Block by block where the model allows it, else on the whole model (``config``: the
    source's config.json, when the caller has read it)."""
    try:
        return blockwise_moments(source_dir, architecture, norm_names, ids, window_limit, config=config)
    except layerwise.Unsupported:
        return whole_moments(source_dir, architecture, norm_names, ids, window_limit, config)


def calibration_ids(source_dir: Path, text: str, label: str, config: dict | None = None) -> torch.Tensor:
    """The calibration text as token ids, with the source's tokenizer."""

    tokenizer = load_tokenizer(source_dir, config)
    if tokenizer is None:
        raise NormswapError(f"{source_dir} has no tokenizer to read the calibration text with")
    ids = tokenize_text(tokenizer, text)
    if ids.numel() < 2:
        raise NormswapError(f"calibration text {label} gives fewer than 2 tokens")
    return ids


def rotated_norms(rotation_plan: RotationPlan, fixed: dict[str, str] | None) -> list[str]:
    """The norms of the stream that rotates: not baked, not per-head, not in a fixed stream."""

    return [norm.name for norm in rotation_plan.plan.norms
            if norm.baked_into is None and not norm.per_head and not in_fixed_stream(norm.name, fixed)]


def text_inputs(source_dir: Path, text_path: str | Path, max_tokens: int,
                config: dict | None) -> tuple[torch.Tensor, dict]:
    """The calibration text's first ``max_tokens`` token ids and its provenance record (the hash
    of the text read: the whole file, or the prefix ``max_tokens`` tokens can span)."""
    text = read_calibration(text_path, max_tokens)
    ids = calibration_ids(source_dir, text, str(text_path), config)[:max_tokens]
    return ids, {"text": Path(text_path).name, "tokens": int(ids.numel()),
                 "text_sha256": hashlib.sha256(text.encode()).hexdigest()}


def calibrate(source_dir: Path, rotation_plan: RotationPlan, spec: str | Path, max_tokens: int,
              config: dict | None = None, make: Callable[[torch.Tensor, dict], Rotation] = pca_rotation, *,
              fixed: dict[str, str] | None = None, media: MediaCalibration | None = None) -> Rotation:
    """The pca rotation (``make``: the free form's or the commuting form's) of the source's stream:
    Σ over every norm of the rotated stream of its input's second moment, measured block by block
    on the calibration text, or for a model that reads audio or images on the inputs ``media``
    reads from ``spec``."""
    if reads_text(rotation_plan.architecture, rotation_plan.config):
        inputs, record = text_inputs(source_dir, spec, max_tokens, config)
    else:
        if media is None:
            raise NormswapError(f"--method pca of a {rotation_plan.architecture.probe} model calibrates on its own kind "
                                "of input, which normswap.api.rotate_checkpoint reads")
        inputs = media.inputs(source_dir, rotation_plan.config, str(spec), max_tokens)
        record = inputs.record
    norms = rotated_norms(rotation_plan, fixed)
    measured = calibration_moments(source_dir, rotation_plan.architecture, norms, inputs, CALIBRATION_WINDOW, config)
    moment = sum(measured.moments[name] for name in norms)
    if not bool(torch.isfinite(moment).all()):  # a Q from it would be NaN: name the input, not the rotation
        raise NormswapError(f"--calibration {spec}: the model's stream on these inputs is not finite (their values "
                            "or the checkpoint's input processing overflow); no rotation can be measured on it")
    return make(moment, {**record, **({"window": measured.window} if measured.window else {}),
                         "norms": len(norms), "mode": measured.mode})
