"""Fold: the tensor math of the conversion, as small pure functions in float64.

Notation: d is the hidden size, 1 the all-ones vector of length d, and C = I - 11ᵀ/d the
projection that removes the mean. For a row vector x, xC = x - mean(x)·1.

* A *writer* adds W·u (+ b) into the residual stream. Replacing W by CW and b by Cb makes every
  write orthogonal to 1; when all writes are, the stream has zero mean, LayerNorm's mean removal
  does nothing, and LayerNorm(x) = RMSNorm(x) exactly (eps included, since Var(x) = mean(x²)).
* A *reader* of a norm computes y = W(γ ⊙ n + β) + b. Folding gives W' = W·diag(γ) and
  b' = b + Wβ, so the norm can output n alone.

Every function takes and returns tensors; ``chunked`` applies one of them over slices of a large
tensor so that a float64 copy of the whole never exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Work on at most this many float64 elements at once (64 MiB).
CHUNK_ELEMENTS = 8 * 1024 * 1024


def centre(weight: torch.Tensor, hidden_axis: int) -> torch.Tensor:
    """Apply C along ``hidden_axis``: w - mean(w over hidden_axis).

    For an embedding table [vocab, d] (hidden_axis=1) each row is centred; for an nn.Linear
    out-projection [d, in] (hidden_axis=0) each column is; for a bias [d] the vector is.
    """
    weight = weight.double()
    return weight - weight.mean(dim=hidden_axis, keepdim=True)


def fold_gain(weight: torch.Tensor, gain: torch.Tensor, input_axis: int) -> torch.Tensor:
    """W·diag(γ): scale the reader's input axis by the norm's gain γ."""
    shape = [1] * weight.dim()
    shape[input_axis] = -1
    return weight.double() * gain.double().reshape(shape)


def fold_bias(
    weight: torch.Tensor, norm_bias: torch.Tensor, reader_bias: torch.Tensor | None, input_axis: int
) -> torch.Tensor:
    """b + Wβ: the reader's bias after the norm's bias β moved into it (W is the *unfolded* weight)."""
    moved = torch.tensordot(weight.double(), norm_bias.double(), dims=([input_axis], [0]))
    return moved if reader_bias is None else reader_bias.double() + moved


def residual_norm_bias(gain: torch.Tensor, norm_bias: torch.Tensor) -> torch.Tensor:
    """β ⊘ γ: the bias a norm must keep once γ is folded but β has nowhere to go.

    A reader without a bias slot computes W(γ ⊙ n + β) = (W·diag(γ))(n + β ⊘ γ), so the norm keeps
    β ⊘ γ as its bias and a unit gain. Requires γ without zeros.
    """
    return norm_bias.double() / gain.double()


def layer_norm_rows(table: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of every row of a lookup table, in float64: γ ⊙ (e - μ)/sqrt(σ² + eps) + β.

    Used to bake a norm that acts on an embedding lookup into the table itself.
    """
    table = table.double()
    mean = table.mean(dim=-1, keepdim=True)
    variance = (table - mean).pow(2).mean(dim=-1, keepdim=True)
    return (table - mean) / torch.sqrt(variance + eps) * gain.double() + bias.double()


def chunked(
    tensor: torch.Tensor,
    transform: Callable[[torch.Tensor], torch.Tensor],
    keep_axis: int,
    out_dtype: torch.dtype,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """``transform`` applied to slices of ``tensor`` taken along an axis other than ``keep_axis``.

    ``transform`` must act independently on each slice along the other axes (centring along the
    hidden axis does; so does folding a gain along the input axis). Results are cast to
    ``out_dtype`` slice by slice, so peak extra memory is one float64 slice.
    """
    if tensor.dim() <= 1 or tensor.numel() <= chunk_elements:
        return transform(tensor).to(out_dtype)
    split_axis = 0 if keep_axis != 0 else 1
    per_index = tensor.numel() // tensor.shape[split_axis]
    step = max(1, chunk_elements // per_index)
    out = torch.empty(tensor.shape, dtype=out_dtype)
    for start in range(0, tensor.shape[split_axis], step):
        piece = tensor.narrow(split_axis, start, min(step, tensor.shape[split_axis] - start))
        out.narrow(split_axis, start, piece.shape[split_axis]).copy_(transform(piece))
    return out


def chunked_bias_fold(
    weight: torch.Tensor, norm_bias: torch.Tensor, reader_bias: torch.Tensor | None, input_axis: int,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """``fold_bias`` computed over slices of the reader's output axis (float64 result)."""
    if weight.dim() != 2 or weight.numel() <= chunk_elements:
        return fold_bias(weight, norm_bias, reader_bias, input_axis)
    out_axis = 1 - input_axis
    step = max(1, chunk_elements // weight.shape[input_axis])
    pieces = []
    for start in range(0, weight.shape[out_axis], step):
        length = min(step, weight.shape[out_axis] - start)
        bias_piece = None if reader_bias is None else reader_bias.narrow(0, start, length)
        pieces.append(fold_bias(weight.narrow(out_axis, start, length), norm_bias, bias_piece, input_axis))
    return torch.cat(pieces)
