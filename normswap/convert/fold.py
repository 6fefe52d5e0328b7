"""Fold: the tensor math of the conversion, as small pure functions in float64.

Notation: d is the hidden size, 1 the all-ones vector of length d, and C = I - 11ᵀ/d the
projection that removes the mean. For a row vector x, xC = x - mean(x)·1.

* A *writer* adds W·u (+ b) into the residual stream. Replacing W by CW and b by Cb makes every
  write orthogonal to 1; when all writes are, the stream has zero mean, LayerNorm's mean removal
  does nothing, and LayerNorm(x) = RMSNorm(x) exactly (eps included, since Var(x) = mean(x²)).
* A *reader* of a norm computes y = W(γ ⊙ n + β) + b. Folding gives W' = W·diag(γ) and
  b' = b + Wβ, so the norm can output n alone.

Every function takes and returns tensors. The last section executes a plan's steps with these
functions: ``compute_tensor`` for one tensor, ``slice_kernel``/``run_kernels`` for the slices the
writer streams (in place on one reused float64 buffer), ``row_kernel`` for the blocks of rows it
streams from file to file, so what the tests check here is what conversion runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from normswap.convert.steps import (
    Bake,
    Centre,
    CentreHeads,
    DivideByGain,
    Fill,
    FoldBias,
    FoldGain,
    Rotate,
    Step,
)

if TYPE_CHECKING:
    from normswap.convert.plan import TensorPlan

# Work on at most this many float64 elements at once (64 MiB) in a whole-tensor bias fold.
CHUNK_ELEMENTS = 8 * 1024 * 1024
# float64 working slice of the streamed steps, reused for every slice of a tensor: 8 MiB stays in cache
SLICE_ELEMENTS = 1 << 20

Read = Callable[[str], torch.Tensor]


def centre(weight: torch.Tensor, hidden_axis: int) -> torch.Tensor:
    """Apply C along ``hidden_axis``: w - mean(w over hidden_axis).

    For an embedding table [vocab, d] (hidden_axis=1) each row is centred; for an nn.Linear
    out-projection [d, in] (hidden_axis=0) each column is; for a bias [d] the vector is.
    """
    return centre_(weight.to(torch.float64, copy=True), hidden_axis)


def centre_(work: torch.Tensor, hidden_axis: int) -> torch.Tensor:
    """``centre`` in place on a float64 ``work`` tensor (the streamed slices)."""
    return work.sub_(work.mean(dim=hidden_axis, keepdim=True))


def centre_heads(weight: torch.Tensor, axis: int, head_dim: int, period: int = 1,
                 members: tuple[int, ...] = (0,)) -> torch.Tensor:
    """Centre each head's block of ``head_dim`` entries along ``axis`` (the output axis of a q or
    k projection, or its bias), in float64.

    A per-head norm computes LN(q_h) for every head's slice q_h = W_h·x + b_h. Replacing W_h by
    C_D·W_h and b_h by C_D·b_h (C_D = I - 11ᵀ/D, D = head_dim) makes every q_h zero-mean for any x,
    so LN(q_h) = RMSNorm(q_h) exactly, and LN of the original q_h equals LN of the centred one
    (LN(q + m·1) = LN(q)): the attention is unchanged. Blocks are taken ``period`` at a time and
    only those at ``members`` are centred (a fused q/k/v projection: period 3, members (0, 1)).
    """
    value = torch.movedim(weight.double(), axis, 0).clone()
    blocks = value.reshape(-1, period, head_dim, *value.shape[1:])
    for member in members:
        blocks[:, member] -= blocks[:, member].mean(dim=1, keepdim=True)
    return torch.movedim(blocks.reshape(value.shape), 0, axis)


def fold_gain(weight: torch.Tensor, gain: torch.Tensor, input_axis: int) -> torch.Tensor:
    """W·diag(γ): scale the reader's input axis by the norm's gain γ."""
    return fold_gain_(weight.to(torch.float64, copy=True), gain.double(), input_axis)


def fold_gain_(work: torch.Tensor, gain: torch.Tensor, input_axis: int) -> torch.Tensor:
    """``fold_gain`` in place on a float64 ``work`` tensor, with a float64 ``gain``."""
    shape = [1] * work.dim()
    shape[input_axis] = -1
    return work.mul_(gain.reshape(shape))


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


# ---------------------------------------------------------------------------------------------
# Rotation of the residual basis.
#
# Once every norm is weightless (γ = 1 folded into its readers, β folded or kept as β ⊘ γ) and
# every write is centred, each norm is RMSNorm(x) = x / rms(x), and for any orthogonal Q
# (QᵀQ = QQᵀ = I): rms(x·Q) = rms(x), so RMSNorm(x·Q) = RMSNorm(x)·Q. Rotating every write by Q
# and un-rotating every read by Qᵀ therefore leaves the function unchanged while the stream
# itself is x·Q. In row-vector notation (x a row of the stream, d its size):
#
# * a writer adds u·W + b to x (W: [in, d]); the rotated stream needs u·W·Q + b·Q;
# * a reader computes n·W + c (W: [d, out]) from n = RMSNorm(x); the rotated n is n·Q, so it
#   needs (n·Q)·(Qᵀ·W) = n·W;
# * a kept norm bias n + β⊘γ becomes n·Q + (β⊘γ)·Q.
#
# On a stored tensor all four are the same contraction of its stream axis with Q,
# t'[.., j, ..] = Σ_k t[.., k, ..]·Q[k, j], whichever way round the tensor stores its axes.


def rotate_axis(tensor: torch.Tensor, rotation: torch.Tensor, axis: int) -> torch.Tensor:
    """t'[.., j, ..] = Σ_k t[.., k, ..]·Q[k, j] along ``axis``, in float64.

    Every rotation identity is this contraction on the tensor's stream axis:

    * a writer's output side, W·Q (and b·Q): Conv1D stores W [in, d] (axis 1); nn.Linear stores
      Wᵀ [d, in] (axis 0), which becomes Qᵀ·Wᵀ; an embedding table E [vocab, d] becomes E·Q;
    * a reader's input side, Qᵀ·W, so that (n·Q)·W' = n·W: Conv1D W [d, out] (axis 0); nn.Linear
      and the head store Wᵀ [out, d] (axis 1), which becomes Wᵀ·Q;
    * the bias a weightless norm keeps, n + β⊘γ, becomes (β⊘γ)·Q (axis 0).

    Acts independently on every slice across ``axis``, so it can run on slices of a tensor.
    """
    tensor, rotation = tensor.double(), rotation.double()
    if axis == tensor.dim() - 1 or axis == -1:
        return tensor @ rotation
    if axis == 0 and tensor.dim() == 2:
        return rotation.T @ tensor
    return torch.movedim(torch.movedim(tensor, axis, -1) @ rotation, -1, axis)


# ---------------------------------------------------------------------------------------------
# Executing a plan's steps with the functions above.


def compute_tensor(plan: TensorPlan, read: Read, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output value of one tensor: its source, transformed by its steps, in float64, cast once
    to ``dtype`` (default the plan's; ``torch.float64`` gives the value before the cast)."""
    dtype = plan.dtype if dtype is None else dtype
    value = torch.zeros(plan.shape, dtype=torch.float64) if plan.source is None else read(plan.source)
    if not plan.steps:
        return value.to(dtype)
    slice_steps = [step for step in plan.steps if step.slice_wise]
    other_steps = [step for step in plan.steps if not step.slice_wise]
    if slice_steps:
        target = torch.float64 if other_steps else dtype
        value = apply_slice_steps(value, slice_steps, read, target, name=plan.name)
    for step in other_steps:
        value = whole_step(step, value.double(), read)
    return value.to(dtype)


def apply_slice_steps(value: torch.Tensor, steps: list[Step], read: Read, out_dtype: torch.dtype, *,
                      name: str = "", slice_elements: int = SLICE_ELEMENTS) -> torch.Tensor:
    """Slice-wise ``steps`` applied in float64 to ``value`` slice by slice, cast to ``out_dtype``.

    Every step acts on whole slices across one axis (the hidden axis a writer is centred along,
    or the input axis a reader's gain scales), so ``value`` is cut along another axis into
    slices of about ``slice_elements``. Each slice is copied into one reused float64 buffer,
    transformed in place, and cast into the output.
    """
    axes = {step.axis for step in steps}
    if len(axes) != 1:
        raise AssertionError(f"{name}: slice-wise steps on different axes {axes}")
    axis = axes.pop()
    kernels = [slice_kernel(step, read) for step in steps]
    out = torch.empty(value.shape, dtype=out_dtype)
    if value.dim() <= 1 or value.numel() == 0:
        out.copy_(run_kernels(kernels, value.to(torch.float64, copy=True)))
        return out
    split = 0 if axis != 0 else 1
    count = value.shape[split]
    step = max(1, slice_elements // (value.numel() // count))
    buffer = torch.empty(min(step, count) * (value.numel() // count), dtype=torch.float64)
    for start in range(0, count, step):
        piece = value.narrow(split, start, min(step, count - start))
        work = buffer[: piece.numel()].view(piece.shape)
        work.copy_(piece)
        out.narrow(split, start, piece.shape[split]).copy_(run_kernels(kernels, work))
    return out


def run_kernels(kernels: list[Callable[[torch.Tensor], torch.Tensor]], work: torch.Tensor) -> torch.Tensor:
    """``work`` through every kernel in order (each may modify it in place)."""
    for kernel in kernels:
        work = kernel(work)
    return work


def slice_kernel(step: Step, read: Read) -> Callable[[torch.Tensor], torch.Tensor]:
    """The float64 slice kernel of a slice-wise ``step``, in place where the math allows.

    Centre: w ← w - mean(w along the hidden axis)      (``centre_``)
    FoldGain: w ← w · γ along the input axis             (``fold_gain_``)
    Bake: w ← LayerNorm(w) row by row                     (``layer_norm_rows``)
    Rotate: w ← w contracted with Q along the stream axis (``rotate_axis``)
    """
    if isinstance(step, Centre):
        return lambda w: centre_(w, step.axis)
    if isinstance(step, FoldGain):
        gain = read(step.gain).double() + step.offset
        return lambda w: fold_gain_(w, gain, step.axis)
    if isinstance(step, Bake):
        gain, bias = read(step.gain), read(step.bias)
        return lambda w: layer_norm_rows(w, gain, bias, step.eps)
    if isinstance(step, Rotate):
        return lambda w: rotate_axis(w, step.rotation.matrix, step.axis)
    raise TypeError(step)


RowKernel = Callable[[torch.Tensor, int], torch.Tensor]


def centres_columns(step: Step) -> bool:
    """Whether ``step`` is C applied along the leading axis (an nn.Linear writer [d, in], each
    column centred): on blocks of whole rows it needs the column means first."""
    return isinstance(step, Centre) and step.axis == 0


def runs_on_rows(step: Step) -> bool:
    """Whether ``step`` can run on a tensor a block of whole rows at a time: a ``row_kernel``, or
    a centring along the leading axis (``centres_columns``)."""
    return _scales_rows(step) or (step.slice_wise and step.axis != 0) or centres_columns(step)


def _scales_rows(step: Step) -> bool:
    return isinstance(step, FoldGain) and step.axis == 0


def row_kernel(step: Step, read: Read) -> RowKernel:
    """The float64 kernel of a ``runs_on_rows`` step other than a leading-axis centring, on a
    block of whole rows: (rows, first row) -> rows, in place.

    A slice-wise step across a non-leading axis acts on each row alone (``slice_kernel``). A gain
    folded along the leading axis scales row i by γ_i, so the block starting at row r takes
    γ[r : r + rows]: the products are those of ``fold_gain_`` on the whole tensor.
    """
    if _scales_rows(step):
        gain = read(step.gain).double() + step.offset
        return lambda w, start: fold_gain_(w, gain.narrow(0, start, w.shape[0]), 0)
    if not runs_on_rows(step) or centres_columns(step):
        raise TypeError(step)
    kernel = slice_kernel(step, read)
    return lambda w, start: kernel(w)


def whole_step(step: Step, value: torch.Tensor, read: Read) -> torch.Tensor:
    """A step that needs the whole float64 tensor ``value``.

    Fill: a constant; DivideByGain: β ⊘ γ (``residual_norm_bias``); CentreHeads: each head's
    block centred (``centre_heads``); FoldBias: b + Wβ
    (``chunked_bias_fold``); Rotate: a kept norm bias, (β⊘γ)·Q (``rotate_axis``).
    """
    if isinstance(step, Fill):
        return torch.full_like(value, step.value)
    if isinstance(step, DivideByGain):
        return residual_norm_bias(read(step.gain).double() + step.offset, value)
    if isinstance(step, CentreHeads):
        return centre_heads(value, step.axis, step.head_dim, step.period, step.members)
    if isinstance(step, FoldBias):
        return chunked_bias_fold(read(step.weight), read(step.norm_bias), value, step.axis)
    if isinstance(step, Rotate):
        return rotate_axis(value, step.rotation.matrix, step.axis)
    if callable(getattr(step, "whole", None)):  # a step declared in a layer above (rotate/) carries its math
        return step.whole(value, read)
    raise TypeError(step)
