"""Sliced checkpoints (SliceGPT): a narrower residual stream, at a measured perplexity cost.

A folded checkpoint (every norm weightless, every write centred) computes the same function in
any orthonormal basis of its stream, and the basis may change at every point where the stream
is read. Slicing measures, on calibration text, the second moment M_i of the centred stream at
the input of every norm i ("signal" i), takes its principal directions Q_i (eigenvectors by
decreasing eigenvalue) and keeps the first k: P_i = Q_i[:, :k]. Then

* a writer into signal i writes u·W·P_i (the embeddings write signal 0; a block's branch
  writes the signal after the norm that feeds it);
* a reader of norm i reads through P_iᵀ·W, and a bias the norm keeps becomes b·P_i;
* where a branch's output joins the residual, the residual changes basis: x_{i+1} = x_i·S_i +
  branch, with the shortcut S_i = P_iᵀ·P_{i+1} (k×k), stored as a tensor in the checkpoint;
* the norms normalise k coordinates but must keep the d-dimensional statistic:
  y/√(|y|²/d + ε) = √(d/k) · y/√(|y|²/k + ε·d/k), so every norm gets the gain √(d/k) and ε·d/k.

With k = d every P_i is orthogonal and the model computes the original function (tested to
float64 round-off). With k < d the least-variance directions are gone and the function changes:
the perplexity on held-out text, before and after, is measured and recorded.

Bases come from the original model's stream (calibrated once, block by block; SliceGPT's
sequential variant recalibrates on the partly sliced model instead). Families are supported
whose adapter declares the block layout (which norm feeds which branch), its ``slice_layout``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from normswap.architectures import ARCHITECTURES, Architecture
from normswap.architectures.spec import SliceLayout
from normswap.checkpoint.names import shard_names
from normswap.checkpoint.provenance import Provenance
from normswap.convert import fold
from normswap.convert.plan import ConversionPlan, TensorPlan
from normswap.dtypes import dtype_name
from normswap.errors import NormswapError
from normswap.rotate import matrices
from normswap.rotate.plan import check_rotatable

# Held out from the calibration text when no --held-out text is given: this share of its tokens,
# and at most this many (the perplexity cost is measured on them).
HELD_OUT_SHARE = 0.1
HELD_OUT_TOKENS = 8192
SHARD_BYTES = 2 << 30


@dataclass
class Role:
    """What slicing does to one tensor: ``kind`` writer/reader/norm_weight/norm_bias, along ``axis``,
    in the basis of signal ``signal``."""

    kind: str
    axis: int
    signal: int


def check_fraction(fraction: object, *, allow_zero: bool = False) -> float:
    low = "0 <=" if allow_zero else "0 <"
    if (not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or math.isnan(fraction)
            or not (0 <= fraction < 1) or (fraction == 0 and not allow_zero)):
        raise NormswapError(f"--slice must be a fraction with {low} f < 1 (the share of the stream's dimensions "
                            f"to delete), not {fraction!r:.30}")
    return float(fraction)


def kept_dimension(d: int, fraction: float) -> int:
    """k = d - round(fraction·d), at least 1."""
    return max(1, d - round(fraction * d))


MIN_HELD_OUT_TOKENS = 16


def check_slice_inputs(fraction: float, d: int, k: int, calibration_tokens: int, held_out_tokens: int) -> None:
    """Refuse a slicing that deletes nothing, a basis measured on fewer tokens than the stream has
    dimensions (its principal directions past the token count are arbitrary), and a perplexity
    cost measured on too few tokens to mean anything."""
    if fraction > 0 and k == d:
        raise NormswapError(f"--slice {fraction:g} deletes 0 of the stream's {d} dimensions; use a larger fraction")
    if calibration_tokens < d:
        raise NormswapError(f"the calibration text gives {calibration_tokens} tokens, fewer than the stream's {d} "
                            "dimensions: the principal directions would be arbitrary; give a longer text")
    if held_out_tokens < MIN_HELD_OUT_TOKENS:
        raise NormswapError(f"only {held_out_tokens} held-out tokens to measure the perplexity cost on (at least "
                            f"{MIN_HELD_OUT_TOKENS}); give --held-out TEXT_FILE or a longer calibration text")


def check_sliceable(source_dir: Path, config: dict) -> tuple[Architecture, SliceLayout]:
    """The adapter and layout of a source that can be sliced; one-line refusals otherwise."""

    provenance = Provenance.of(config, source_dir)
    if provenance is not None and provenance.slicing is not None:
        raise NormswapError(f"{source_dir} is already sliced (to {provenance.slicing.get('hidden_size')} dimensions); "
                            "slice the original instead")
    architecture, family_config, _ = check_rotatable(source_dir, config)
    model_type = family_config.get("model_type")
    if architecture.slice_layout is None:
        declared = sorted(name for name, each in ARCHITECTURES.items() if each.slice_layout is not None)
        raise NormswapError(f"cannot slice a {model_type} checkpoint: slicing needs the family's block layout (which "
                            f"norm feeds which branch), declared for {', '.join(declared)}")
    if family_config.get("add_cross_attention"):
        raise NormswapError(f"cannot slice this {model_type} checkpoint: its cross-attention adds a third residual "
                            "branch that the layout does not declare")
    return architecture, architecture.slice_layout


def signal_norms(layout: SliceLayout, n_blocks: int) -> list[str]:
    """The norms in stream order: signal i is the input of the i-th."""
    names = [f"{layout.blocks}.{index}.{norm}" for index in range(n_blocks) for norm, _ in layout.branches]
    return names + [layout.final_norm]


def kept_bases(moments: dict[str, torch.Tensor], norms: list[str], k: int) -> tuple[list[torch.Tensor], list[float]]:
    """P_i = the first k principal directions of signal i (d×k, float64), and the share of the
    stream's energy each keeps."""
    bases, kept = [], []
    for name in norms:
        matrix, values = matrices.principal_rotation(moments[name])
        values = values.clamp(min=0)
        total = float(values.sum())
        bases.append(matrix[:, :k].contiguous())
        kept.append(float(values[:k].sum()) / total if total > 0 else 1.0)
    return bases, kept


def tensor_roles(names: list[str], architecture: Architecture, layout: SliceLayout,
                 norms: list[str]) -> dict[str, Role]:
    """Every tensor that touches the stream, with its role (the rest pass through unchanged)."""
    roles: dict[str, Role] = {}
    per_block = len(layout.branches)
    for name in names:
        writer = next((w for w in architecture.writers if re.fullmatch(w.pattern, name)), None)
        if writer is not None:
            roles[name] = Role("writer", writer.hidden_axis, _written_signal(name, layout, per_block))
    for signal, norm in enumerate(norms):
        spec = next(s for s in architecture.norms if re.fullmatch(s.pattern, norm))
        groups = re.fullmatch(spec.pattern, norm).groupdict()
        for reader in spec.readers:
            weight = reader.weight.format(**groups)
            if weight in names:
                roles[weight] = Role("reader", reader.input_axis, signal)
        for kind in ("weight", "bias"):
            if f"{norm}.{kind}" in names:
                roles[f"{norm}.{kind}"] = Role(f"norm_{kind}", 0, signal)
    return roles


def _written_signal(name: str, layout: SliceLayout, per_block: int) -> int:
    if name in layout.embeddings:
        return 0
    for position, (_, branch) in enumerate(layout.branches):
        found = re.fullmatch(rf"{re.escape(layout.blocks)}\.(\d+)\.{re.escape(branch)}\..*", name)
        if found:
            return int(found.group(1)) * per_block + position + 1
    raise NormswapError(f"cannot slice: the writer {name} is in no branch of the declared block layout")


def sliced_tensor(name: str, value: torch.Tensor, role: Role | None, bases: list[torch.Tensor], d: int, *,
                  signal: int | None = None) -> torch.Tensor:
    """One tensor (float64) in the sliced model: projected onto its signal's kept basis
    (``bases[signal]``, by default the role's)."""
    if role is None:
        return value
    basis = bases[role.signal if signal is None else signal]
    if role.kind == "norm_weight":
        if not bool((value == 1).all()):
            raise NormswapError(f"cannot slice: the norm weight {name} is not 1 (the norm must be weightless)")
        k = basis.shape[1]
        return torch.full((k,), math.sqrt(d / k), dtype=torch.float64)
    return fold.rotate_axis(value, basis, role.axis)


def shortcut_tensors(layout: SliceLayout, bases: list[torch.Tensor], n_blocks: int) -> dict[str, torch.Tensor]:
    """S = P_iᵀ·P_{i+1} for every residual add, named as ``apply_slicing`` registers it."""
    shortcuts = {}
    per_block = len(layout.branches)
    for index in range(n_blocks):
        for position, (_, branch) in enumerate(layout.branches):
            signal = index * per_block + position
            shortcuts[f"{layout.blocks}.{index}.shortcut_{branch}.weight"] = bases[signal].T @ bases[signal + 1]
    return shortcuts


def stream_axes(roles: dict[str, Role], layout: SliceLayout) -> list[list]:
    """(pattern, axis) for every parameter whose stream axis is cut, the block index generalised."""
    block = re.escape(layout.blocks) + r"\.\d+\."
    found = {}
    for name, role in roles.items():
        inside = re.fullmatch(rf"{re.escape(layout.blocks)}\.\d+\.(.*)", name)
        found[block + re.escape(inside.group(1)) if inside else re.escape(name)] = role.axis
    return [[pattern, axis] for pattern, axis in sorted(found.items())]


@dataclass(frozen=True, eq=False)
class Sliced:
    """A whole-tensor step: project the float64 value onto its signal's kept basis (``sliced_tensor``)."""

    name: str
    role: Role
    basis: torch.Tensor = field(repr=False)
    d: int
    slice_wise: bool = False

    def whole(self, value: torch.Tensor, read: object) -> torch.Tensor:
        return sliced_tensor(self.name, value, self.role, [self.basis], self.d, signal=0)


@dataclass(frozen=True, eq=False)
class Constant:
    """A whole-tensor step: a value computed while planning (a shortcut matrix)."""

    value: torch.Tensor = field(repr=False)
    slice_wise: bool = False

    def whole(self, value: torch.Tensor, read: object) -> torch.Tensor:
        return self.value


def sliced_plan(plan: ConversionPlan, roles: dict[str, Role], bases: list[torch.Tensor],
                extra: dict[str, torch.Tensor], dtype: torch.dtype, d: int) -> ConversionPlan:
    """``plan`` with every stream tensor projected (its stream axis cut to k) and the shortcut
    matrices added, in name order, in shards of at most ``SHARD_BYTES``: the streaming writer
    then computes and writes one tensor group at a time, like every other write path."""
    tensors: dict[str, TensorPlan] = {}
    for name in sorted([*plan.tensors, *extra]):
        if name in extra:
            tensors[name] = TensorPlan(name, None, tuple(extra[name].shape), dtype_name(dtype), "",
                                       [Constant(extra[name])])
            continue
        tensor, role = plan.tensors[name], roles.get(name)
        if role is None:
            tensors[name] = replace(tensor, shard="")
            continue
        shape = list(tensor.shape)
        shape[role.axis] = bases[role.signal].shape[1]
        tensors[name] = replace(tensor, shape=tuple(shape), shard="",
                                steps=[*tensor.steps, Sliced(name, role, bases[role.signal], d)])
    shards = _assign_shards(list(tensors.values()))
    return replace(plan, tensors=tensors, shards=shards)


def _assign_shards(tensors: list[TensorPlan]) -> list[str]:
    """Greedy shards of at most ``SHARD_BYTES`` in order, named as transformers names them."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for tensor in tensors:
        if size and size + tensor.nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    files = shard_names(len(groups))
    for file, group in zip(files, groups, strict=True):
        for tensor in group:
            tensor.shard = file
    return files


def split_held_out(ids: torch.Tensor, held_out: torch.Tensor | None, max_calibration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration ids, held-out ids): the held-out text's, else the calibration text's last tokens."""
    if held_out is None:
        count = min(HELD_OUT_TOKENS, max(2, int(ids.numel() * HELD_OUT_SHARE)))
        if ids.numel() - count < 2:
            raise NormswapError("the calibration text is too short to hold out text for the perplexity cost; "
                                "give --held-out TEXT_FILE")
        ids, held_out = ids[:-count], ids[-count:]
    return ids[:max_calibration], held_out[:HELD_OUT_TOKENS]


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def slicing_block(layout: SliceLayout, roles: dict[str, Role], fraction: float, d: int, k: int,
                  kept: list[float]) -> dict:
    """What ``apply_slicing`` needs to shape the model, and what the slicing kept."""
    return {
        "exact": False, "method": "pca per signal (SliceGPT)", "fraction": fraction, "hidden_size": k,
        "original_hidden_size": d, "norm_gain": math.sqrt(d / k), "stream_axes": stream_axes(roles, layout),
        "blocks": layout.blocks, "branches": [list(pair) for pair in layout.branches],
        "energy_kept": {"min": min(kept), "mean": sum(kept) / len(kept)},
    }

