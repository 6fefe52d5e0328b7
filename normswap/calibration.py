"""Calibration for ``rotate --method pca``: the second moment of the residual stream on a text."""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.rotation_matrix import Rotation, pca_rotation

if TYPE_CHECKING:
    from normswap.rotation import RotationPlan

# at most this many tokens, in windows of at most this many positions
DEFAULT_CALIBRATION_TOKENS = 32768
CALIBRATION_WINDOW = 512


def read_calibration(path: str | Path) -> str:
    path = Path(path).expanduser()
    if not path.is_file():
        raise NormswapError(f"calibration text not found: {path}")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise NormswapError(f"cannot read calibration text {path}: {error.strerror or error}") from None
    if not text.strip():
        raise NormswapError(f"calibration text is empty: {path}")
    return text


@torch.no_grad()
def stream_second_moment(model: nn.Module, norm_names: list[str], ids: torch.Tensor, window: int) -> torch.Tensor:
    """M = Σ xᵀx (float64) over every position of ``ids`` and every norm's input x, centred.

    The norms' inputs are the residual stream at every point where it is read; centring gives the
    stream of the converted model (C·x), which is what Q rotates.
    """
    moment = None

    def hook(module, args, kwargs):
        nonlocal moment
        x = args[0] if args else kwargs["hidden_states"]
        x = x.detach().double().reshape(-1, x.shape[-1])
        x = x - x.mean(-1, keepdim=True)
        product = x.T @ x
        moment = product if moment is None else moment + product

    handles = [model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True) for name in norm_names]
    try:
        for start in range(0, ids.numel(), window):
            piece = ids[start:start + window]
            if piece.numel() < 2:
                continue
            model(input_ids=piece.unsqueeze(0), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if moment is None:
        raise NormswapError("the calibration text gives no tokens to measure the stream on")
    return moment


def calibrate(source_dir: Path, rotation_plan: RotationPlan, text_path: str | Path, max_tokens: int) -> Rotation:
    """The pca rotation of the source's stream on the calibration text (the whole model is loaded once)."""
    from normswap.analysis.collect import context_length
    from normswap.evaluation.perplexity import tokenize_text
    from normswap.verify.compare import load_tokenizer

    text = read_calibration(text_path)
    tokenizer = load_tokenizer(source_dir)
    if tokenizer is None:
        raise NormswapError(f"{source_dir} has no tokenizer to read the calibration text with")
    ids = tokenize_text(tokenizer, text)[:max_tokens]
    if ids.numel() < 2:
        raise NormswapError(f"calibration text {text_path} gives fewer than 2 tokens")
    from normswap.verify.rotated import reference_model

    model = reference_model(source_dir, rotation_plan.architecture)
    norms = [norm.name for norm in rotation_plan.plan.norms if norm.baked_into is None]
    window = min(CALIBRATION_WINDOW, context_length(model))
    with _threads():
        moment = stream_second_moment(model, norms, ids, window)
    del model
    gc.collect()
    calibration = {"text": Path(text_path).name, "tokens": int(ids.numel()),
                   "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "window": window}
    return pca_rotation(moment, calibration)


class _threads:
    """Fix torch's thread count while calibrating, so the same text gives the same Q bit for bit."""

    def __enter__(self):
        self.previous = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)
