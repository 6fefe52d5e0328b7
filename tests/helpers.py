"""Shared test helpers: tiny random models that look trained, and exactness checks against float64.

A random init leaves γ = 1, β = 0 and zero-mean embeddings, which would hide most mistakes. So
``make_hard`` moves every norm's gain far from 1 and bias far from 0, gives embeddings and biases
a large mean, and adds one "massive" residual dimension, as trained GPT-2 has.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import normswap

MASSIVE_DIM = 3


@torch.no_grad()
def make_hard(model: nn.Module, seed: int = 0) -> nn.Module:
    """Perturb a freshly initialised model so that every conversion step matters."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=generator)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                module.weight.copy_(0.5 + 1.5 * rand(module.weight.shape))
            if module.bias is not None:
                module.bias.copy_(0.5 * randn(module.bias.shape))
        elif isinstance(module, nn.Embedding):
            d = module.weight.shape[1]
            offset = 0.3 + 0.2 * randn(d)
            offset[MASSIVE_DIM % d] += 3.0
            module.weight.add_(offset)
        elif hasattr(module, "bias") and isinstance(getattr(module, "bias", None), nn.Parameter):
            module.bias.copy_(0.2 * randn(module.bias.shape) + 0.3)
        if isinstance(module, nn.Conv2d):
            # patch embeddings write the stream: give every output channel a shared mean
            module.weight.add_(0.02 + 0.01 * randn(1, *module.weight.shape[1:]))
    for name, parameter in model.named_parameters():
        # learned position tables and class tokens that are bare parameters
        if parameter.dim() >= 1 and any(key in name for key in ("position_embedding", "cls_token", "class_embedding")):
            if not name.endswith(".weight") or "position_embedding" in name:
                parameter.add_(0.5)
    return model


def save(model: nn.Module, path: Path, tokenizer=None) -> Path:
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def token_ids(vocab_size: int, batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def load(path: Path, how: str, dtype: torch.dtype, auto: str = "AutoModelForCausalLM") -> nn.Module:
    """Load a checkpoint: ``stock`` classes, ``remote`` code, ``normswap`` loader, or the ``original``."""
    cls = getattr(transformers, auto)
    if how in ("stock", "original"):
        model = cls.from_pretrained(path, dtype=dtype)
    elif how == "remote":
        model = cls.from_pretrained(path, dtype=dtype, trust_remote_code=True)
    elif how == "normswap":
        model = normswap.load(path, dtype=dtype)
    else:
        raise ValueError(how)
    return model.eval()


@torch.no_grad()
def causal_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.double()


@torch.no_grad()
def vision_outputs(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """A vision model's logits, or (without a classifier) its last hidden state and pooled output."""
    outputs = model(pixel_values=pixels.to(model.dtype))
    if getattr(outputs, "logits", None) is not None:
        return outputs.logits.double()
    return torch.cat([outputs.last_hidden_state.double().flatten(), outputs.pooler_output.double().flatten()])


def assert_no_layer_norm(model: nn.Module) -> None:
    layer_norms = [name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)]
    assert not layer_norms, f"LayerNorm modules left: {layer_norms[:3]}"
    assert any(getattr(module, "is_normswap_rmsnorm", False) for module in model.modules())


def quick_first(values: list) -> list:
    """Parametrize values of one argument of which only the first is in the quick loop (-m "not
    slow"): the others prove the same property on another input, so they are marked slow."""
    return [values[0], *(pytest.param(value, marks=pytest.mark.slow) for value in values[1:])]


def leftovers(parent: Path) -> list[str]:
    """Temporary or partial outputs normswap might have left in ``parent``."""
    return sorted(p.name for p in Path(parent).iterdir() if "normswap-tmp" in p.name or "normswap-old" in p.name)


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """Each tensor's dtype as a safetensors file's own header records it (``F16``, ``F32``...)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return {name: entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def converted_dir(src: Path, tmp: Path, dtype: torch.dtype, fold_gains: bool) -> Path:
    """Where ``check_exact`` writes the conversion of ``src`` with ``dtype`` weights."""
    name = str(dtype).removeprefix("torch.")
    return tmp / f"{src.name}-{name}-{'fold' if fold_gains else 'plain'}"


def check_exact(
    src: Path,
    tmp: Path,
    *,
    forward=causal_logits,
    inputs=None,
    auto: str = "AutoModelForCausalLM",
    fold_gains: bool = False,
    loaders: tuple[str, ...] = ("stock", "remote"),
    fp32_tol: float = 1e-4,
    fp64_tol: float = 1e-9,
    check_model: Callable[[Path, str, nn.Module], None] | None = None,
) -> dict:
    """Convert ``src`` twice and compare every loader with the original run in float64.

    float64 weights (built-in verification off) must match to ``fp64_tol``; float32 weights
    (built-in verification on, and it must pass) to ``fp32_tol``, both relative to max(1, max
    |reference|). The outputs are at ``converted_dir``. ``check_model(out, loader, model)`` runs on
    every loaded model. Returns the max |Δ| found per (dtype, loader)."""
    reference = forward(load(src, "original", torch.float64, auto), inputs)
    scale = max(1.0, float(reference.abs().max()))
    errors = {}
    for dtype, tolerance in ((torch.float64, fp64_tol), (torch.float32, fp32_tol)):
        name = str(dtype).removeprefix("torch.")
        out = converted_dir(src, tmp, dtype, fold_gains)
        block = normswap.convert_checkpoint(src, out, fold_gains=fold_gains, dtype=dtype,
                                            verification="auto" if dtype == torch.float32 else "none")
        if dtype == torch.float32:
            assert block["verification"]["passed"], block["verification"]
        for how in loaders:
            model = load(out, how, dtype, auto)
            if how != "stock":
                assert_no_layer_norm(model)
            if check_model is not None:
                check_model(out, how, model)
            error = float((forward(model, inputs) - reference).abs().max())
            errors[(name, how)] = error
            assert error <= tolerance * scale, f"{name} {how}: max |Δ| = {error:.3g} > {tolerance * scale:.3g}"
    return errors


def tiny_gpt2(path: Path) -> Path:
    """A tiny two-layer GPT-2 saved at ``path`` (safetensors, tied head, a vocabulary of 50)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    return save(make_hard(transformers.GPT2LMHeadModel(config)), path)


@contextmanager
def deep_tree(top: Path, depth: int = 1100) -> Iterator[Path]:
    """``top``, a folder with folders nested ``depth`` deep below it (deeper than the interpreter's
    recursion limit), removed bottom-up afterwards: ``shutil.rmtree``, and pytest's clean-up of
    its temporary folders with it, recurses and cannot remove it."""
    folders = [top]
    top.mkdir()
    for _ in range(depth):
        folders.append(folders[-1] / "a")
        folders[-1].mkdir()
    try:
        yield top
    finally:
        for folder in reversed(folders):
            try:
                folder.rmdir()
            except FileNotFoundError:
                pass
