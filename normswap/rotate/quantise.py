"""Round-to-nearest fake quantisation of weights and activations, to measure what a rotation does.

Symmetric, per output channel (optionally per group of ``group_size`` input weights within a
channel): with b bits, q_max = 2^(b-1) - 1 and, for each channel (or group) w,

    s = max|w| / q_max,    ŵ = s · clamp(round(w / s), -q_max, q_max)

(round to nearest, computed as w·(1/s) in float32 as torch's kernel does, so a value that
lands exactly on a tie may go either way; a channel of zeros keeps s = 1 and stays zero). The rounding itself is
torch's maintained primitive ``torch.fake_quantize_per_channel_affine`` with zero point 0; this
module only chooses the scales and the channel layout. Weights are returned dequantised, so a
model runs unchanged and only its weights carry the quantisation error. Activations are quantised
the same way per token, at every linear layer's input, by forward pre-hooks (``quantise_activations``).

torch's own primitive is used rather than a quantisation library's: torchao's CPU paths are weight
layouts for real low-bit kernels (not a fake-quantised W4A8 that runs every family unchanged), and
optimum-quanto would add a dependency for the same round-to-nearest arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn


def fake_quantise(weight: torch.Tensor, bits: int, input_axis: int, group_size: int | None = None) -> torch.Tensor:
    """ŵ for a weight whose input dimension is ``input_axis`` (nn.Linear [out, in]: 1; Conv1D [in, out]: 0)."""
    if bits < 2 or bits > 16:
        raise ValueError(f"bits must be in 2..16, not {bits}")
    if weight.dim() != 2:
        raise ValueError("fake_quantise takes a 2-D weight")
    rows = weight.float().movedim(input_axis, 1)  # [out, in]: one channel per row
    out_features, in_features = rows.shape
    if group_size is not None:
        if group_size <= 0 or in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide the input dimension {in_features}")
        rows = rows.reshape(out_features * in_features // group_size, group_size)
    q_max = 2 ** (bits - 1) - 1
    scale = rows.abs().amax(dim=1) / q_max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_point = torch.zeros(rows.shape[0], dtype=torch.int32)
    quantised = torch.fake_quantize_per_channel_affine(rows.contiguous(), scale, zero_point, 0, -q_max, q_max)
    return quantised.reshape(out_features, in_features).movedim(1, input_axis).to(weight.dtype).contiguous()


def linear_layers(model: nn.Module, within: str | None = None) -> list[tuple[str, nn.Module, int]]:
    """(name, module, input axis) of every nn.Linear and transformers Conv1D, optionally under ``within``."""
    from transformers.pytorch_utils import Conv1D

    root = model.get_submodule(within) if within else model
    prefix = f"{within}." if within else ""
    found = []
    for name, module in root.named_modules():
        if isinstance(module, nn.Linear):
            found.append((prefix + name, module, 1))
        elif isinstance(module, Conv1D):
            found.append((prefix + name, module, 0))
    return found


@torch.no_grad()
def quantise_model(model: nn.Module, bits: int, group_size: int | None = None, within: str | None = None) -> int:
    """Replace every linear layer's weight (under ``within``) by its fake-quantised value; returns the count.

    A group size that does not divide a layer's input dimension falls back to per-channel for it.
    """
    layers = linear_layers(model, within)
    for _, module, input_axis in layers:
        groups = group_size if group_size and module.weight.shape[input_axis] % group_size == 0 else None
        module.weight.copy_(fake_quantise(module.weight, bits, input_axis, groups))
    return len(layers)


# ---------------------------------------------------------------------------------------------
# Activations: what a residual rotation is for. A W·A·-bit model quantises every linear layer's
# input too, per token (one scale per row of x, s = max|x_t| / q_max, symmetric), with the same
# torch primitive along the token axis. A token with one massive coordinate gets a large scale
# and every other coordinate of it rounds to few levels; a rotation spreads that coordinate.

# label -> (weight bits, weight group size, activation bits or None): weight-only RTN at int8, int4
# and int4 in groups of 128, then W8A8 and W4A8 (every linear layer's input per token at 8 bits)
QUANTISERS = {"int8": (8, None, None), "int4": (4, None, None), "int4-g128": (4, 128, None),
              "W8A8": (8, None, 8), "W4A8": (4, None, 8)}


def apply_quantiser(model: nn.Module, label: str, within: str | None = None) -> int:
    """Fake-quantise ``model`` in place as ``QUANTISERS[label]`` says; returns the weight layers quantised."""
    bits, group, activation_bits = QUANTISERS[label]
    count = quantise_model(model, bits, group, within=within)
    if activation_bits:
        quantise_activations(model, activation_bits, within=within)
    return count


@torch.no_grad()
def fake_quantise_tokens(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x̂ with every token (row over the last axis) quantised symmetrically to ``bits``, per token
    (a measurement: no gradient flows through it)."""
    rows = x.float().reshape(-1, x.shape[-1]).contiguous()
    q_max = 2 ** (bits - 1) - 1
    scale = rows.abs().amax(dim=1) / q_max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero_point = torch.zeros(rows.shape[0], dtype=torch.int32)
    quantised = torch.fake_quantize_per_channel_affine(rows, scale, zero_point, 0, -q_max, q_max)
    return quantised.reshape(x.shape).to(x.dtype)


def quantise_activations(model: nn.Module, bits: int, within: str | None = None) -> list:
    """Fake-quantise the input of every linear layer under ``within`` per token to ``bits`` (forward
    pre-hooks); returns the hook handles (``handle.remove()`` undoes it)."""

    def hook(module, args):
        return (fake_quantise_tokens(args[0], bits), *args[1:])

    return [module.register_forward_pre_hook(hook) for _, module, _ in linear_layers(model, within)]
