"""Record the statistics of ``stats.py`` at the input of every norm of a model, over real tokens.

The model is left untouched apart from temporary forward pre-hooks: each norm's input is turned into
float64 per-token statistics on the fly (nothing of size tokens × d is kept), so memory stays small
whatever the number of tokens.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.analysis import DEFAULT_TEXT, stats  # noqa: F401  (DEFAULT_TEXT: re-exported)
from normswap.errors import NormswapError
from normswap.runtime.reference import context_length  # noqa: F401  (re-exported for scripts)

# Norm attribute names by role; the first match wins, cross-attention before self-attention.
_KIND_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("cross", re.compile(r"cross|encoder_attn")),
    ("attention", re.compile(r"^(ln_1|input_layernorm|self_attn_layer_norm|attention_norm|attn_norm|ln_attn|"
                             r"layer_norm1|norm1|pre_attention_layernorm|layernorm_before)$")),
    ("mlp", re.compile(r"^(ln_2|post_attention_layernorm|final_layer_norm|ffn_norm|mlp_norm|ln_mlp|"
                       r"layer_norm2|norm2|pre_feedforward_layernorm|layernorm_after)$")),
)


def is_norm(module: nn.Module) -> bool:
    """An ``nn.LayerNorm``, a normswap ``RMSNorm`` (duck-typed), or a leaf module named *LayerNorm/*RMSNorm."""
    if isinstance(module, nn.LayerNorm) or getattr(type(module), "is_normswap_rmsnorm", False):
        return True
    # Family-specific norms (LlamaRMSNorm, T5LayerNorm...) so that native RMSNorm models can be compared.
    named_like_norm = type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
    return named_like_norm and not any(True for _ in module.children())


def norm_parameters(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """(γ, β, eps) of a norm module; γ/β None when absent or not a 1-D vector."""

    def vector(name: str) -> torch.Tensor | None:
        value = getattr(module, name, None)
        return value.detach() if isinstance(value, torch.Tensor) and value.dim() == 1 else None

    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", 1e-5)
    return vector("weight"), vector("bias"), float(eps)


@dataclass(frozen=True)
class NormPosition:
    """Where a norm sits: its stack (encoder/decoder/""), layer index (None outside layers) and role."""

    stack: str
    layer: int | None
    kind: str  # attention | mlp | cross | final | embedding | other


def classify(name: str) -> NormPosition:
    """Position of a norm from its module path, e.g. ``transformer.h.3.ln_1`` → ("", 3, "attention")."""
    parts = name.split(".")
    # Two-tower models (CLIP) name their towers; encoder-decoders (Whisper) their stacks.
    # The outermost match decides: a decoder's ``encoder_attn_layer_norm`` belongs to the decoder.
    stack = next((p for p in ("vision", "text") if f"{p}_model" in parts), "") or next(
        (p for part in parts for p in ("encoder", "decoder") if part.startswith(p)), "")
    layer = next((int(part) for part in parts if part.isdigit()), None)
    leaf = parts[-1].lower()
    if layer is None:
        kind = "embedding" if "emb" in leaf else "final"
    else:
        kind = next((k for k, pattern in _KIND_PATTERNS if pattern.search(leaf)), "other")
    return NormPosition(stack, layer, kind)


@dataclass
class NormRecord:
    """Per-token statistics gathered at one norm's input."""

    name: str
    norm_class: str
    position: NormPosition
    d: int
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    cos: list[torch.Tensor] = field(default_factory=list)
    ratio: list[torch.Tensor] = field(default_factory=list)
    error: list[torch.Tensor] = field(default_factory=list)
    rms: list[torch.Tensor] = field(default_factory=list)
    first: list[torch.Tensor] = field(default_factory=list)  # token is at position 0 of its window
    along_sq: float = 0.0  # Σ_t d μ_t²
    total_sq: float = 0.0  # Σ_t ‖x_t‖²
    dims: stats.MeanDimAccumulator | None = None

    def update(self, x: torch.Tensor) -> None:
        """Add the tokens of one norm input ``x`` ([batch, positions, d], or any [..., d])."""
        first = torch.zeros(x.shape[:-1], dtype=torch.bool)
        if x.dim() == 3:
            first[:, 0] = True
        self.first.append(first.reshape(-1))
        x = x.detach().to(torch.float64).reshape(-1, self.d)
        # Per-token results are small; keep them on the CPU whatever device the model runs on.
        self.cos.append(stats.cos_to_ones(x).cpu())
        self.ratio.append(stats.rms_std_ratio(x).cpu())
        self.error.append(stats.naive_swap_error(x, self.weight, self.bias, self.eps).cpu())
        self.rms.append(x.pow(2).mean(-1).sqrt().cpu())
        self.along_sq += float(x.mean(-1).pow(2).sum() * self.d)
        self.total_sq += float(x.pow(2).sum())
        if self.dims is None:
            self.dims = stats.MeanDimAccumulator(self.d)
        self.dims.update(x)

    def summary(self, top_dims: int = 5) -> dict:
        """The figures reported for this norm (see ``stats`` for the definitions)."""
        cos = torch.cat(self.cos)
        first = torch.cat(self.first)
        return {
            "name": self.name,
            "class": self.norm_class,
            "stack": self.position.stack,
            "layer": self.position.layer,
            "kind": self.position.kind,
            "d": self.d,
            "tokens": int(cos.numel()),
            "cos": stats.summarise(cos),
            "abs_cos": stats.summarise(cos.abs()),
            # Per token the share |μ|√d/‖x‖ is |cos θ|; the pooled share weights tokens by ‖x‖².
            "mean_share": float(cos.abs().mean()),
            "isotropic_mean_share": stats.isotropic_mean_abs_cos(self.d),
            "pooled_share": math.sqrt(self.along_sq / self.total_sq) if self.total_sq > 0 else 0.0,
            # Position 0 of a window is special in trained GPT-2-style models (attention sink,
            # massive activations), so its share is also given apart.
            "mean_share_first_position": float(cos[first].abs().mean()) if first.any() else math.nan,
            "mean_share_other_positions": float(cos[~first].abs().mean()) if (~first).any() else math.nan,
            "rms_over_std": stats.summarise(torch.cat(self.ratio)),
            "naive_error": stats.summarise(torch.cat(self.error)),
            "input_rms": stats.summarise(torch.cat(self.rms)),
            "mean_dims": self.dims.top(top_dims) if self.dims is not None else [],
        }


def find_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every norm module of ``model`` with its path, in registration order."""
    return [(name, module) for name, module in model.named_modules() if name and is_norm(module)]


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


class NormRecorder:
    """Context manager: hooks every norm of ``model`` and records its inputs into ``NormRecord``s.

    ``records`` is ordered by first call during the forward pass (the data-flow order), which is the
    order tables and plots use.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._norms = find_norms(model)
        if not self._norms:
            raise NormswapError("the model has no LayerNorm or RMSNorm modules to measure")
        self._records: dict[str, NormRecord] = {}
        self._handles: list = []

    def _hook(self, name: str, module: nn.Module):
        def hook(_module, args, kwargs):
            x = _first_tensor(args, kwargs)
            if x is None or not x.is_floating_point():
                return None
            record = self._records.get(name)
            if record is None:
                weight, bias, eps = norm_parameters(module)
                record = NormRecord(name, type(module).__name__, classify(name), x.shape[-1], weight, bias, eps)
                self._records[name] = record
            record.update(x)
            return None

        return hook

    def __enter__(self) -> NormRecorder:
        for name, module in self._norms:
            self._handles.append(module.register_forward_pre_hook(self._hook(name, module), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def records(self) -> list[NormRecord]:
        return list(self._records.values())


def windows(ids: torch.Tensor, seq_len: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Cut a 1-D id sequence into [B, seq_len] batches of consecutive windows (last one may be shorter)."""
    full = ids.numel() // seq_len
    if full:
        stacked = ids[: full * seq_len].reshape(full, seq_len)
        for start in range(0, full, batch_size):
            yield stacked[start:start + batch_size]
    rest = ids[full * seq_len:]
    if rest.numel():
        yield rest.reshape(1, -1)


def _forward(model: nn.Module, input_ids: torch.Tensor) -> None:
    config = getattr(model, "config", None)
    kwargs = {"input_ids": input_ids}
    if getattr(config, "is_encoder_decoder", False):
        # The same text on both sides gives each stack a realistic input.
        kwargs["decoder_input_ids"] = input_ids
    try:
        model(**kwargs, use_cache=False)
    except TypeError:
        model(**kwargs)


def run_geometry(model: nn.Module, token_ids: torch.Tensor, *, seq_len: int | None = None,
                 batch_size: int = 4, top_dims: int = 5) -> list[dict]:
    """Run ``model`` over ``token_ids`` (1-D) and return one summary dict per norm, in data-flow order."""
    seq_len = min(seq_len or context_length(model), context_length(model))
    batches = ({"input_ids": batch} for batch in windows(token_ids.reshape(-1).long(), seq_len, batch_size))
    return run_geometry_on(model, batches, top_dims=top_dims)


def _forward_inputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    parameter = next(model.parameters())
    moved = {k: v.to(parameter.device, dtype=parameter.dtype if v.is_floating_point() else v.dtype)
             for k, v in inputs.items()}
    if "input_ids" in moved and set(moved) == {"input_ids"}:
        _forward(model, moved["input_ids"])
    elif "pixel_values" in moved and "input_ids" not in moved and hasattr(model, "get_image_features"):
        model.get_image_features(pixel_values=moved["pixel_values"])  # a two-tower model's image tower alone
    else:
        model(**moved)


def run_geometry_on(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], *, top_dims: int = 5) -> list[dict]:
    """Run ``model`` on each batch of keyword inputs (token ids, audio features, pixels) and return
    one summary dict per norm, in data-flow order."""
    was_training = model.training
    model.eval()
    try:
        with NormRecorder(model) as recorder, torch.no_grad():
            for inputs in batches:
                _forward_inputs(model, inputs)
    finally:
        model.train(was_training)
    return [record.summary(top_dims) for record in recorder.records]
