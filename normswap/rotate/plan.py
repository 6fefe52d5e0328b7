"""The plan of a rotation: which sources can be rotated, the fold-everything conversion plan of an
original (or the identity plan of a folded conversion), and the ``Rotate`` step added to every
writer, norm reader and kept norm bias (``normswap.rotate.pipeline`` explains the identities).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from normswap.architectures import Architecture, architecture_for
from normswap.checkpoint.provenance import Provenance, original_model_type
from normswap.checkpoint.source import CheckpointReader
from normswap.convert import planning
from normswap.convert.plan import ClassNames, ConversionPlan, Structure, build_plan
from normswap.convert.steps import Rotate
from normswap.errors import NormswapError
from normswap.modeling import build
from normswap.rotate.matrices import Rotation

# ---------------------------------------------------------------------------------------------
# What can be rotated


def refusal(architecture: Architecture, config: dict) -> str | None:
    """Why a family (as configured) cannot be rotated exactly, or None."""
    name = config.get("model_type")
    structure = Structure.from_json(architecture.structure(config))
    for kind, paths in (("centre_input", structure.centre_input), ("centre_output", structure.centre_output)):
        if paths:
            return (f"{name} centres part of its stream at run time ({kind}); mean removal along 1 does not "
                    "commute with a rotation, so those norms cannot be made rotation-invariant")
    for norm in architecture.norms:
        if norm.output_is_model_output:
            return (f"its final norm's output is a model output ({norm.pattern.replace(chr(92), '')} gives {name}'s "
                    "last hidden state): its gains cannot be folded and the output would come out rotated")
    if architecture.probe != "causal_lm":
        return f"rotation covers decoder-only language models; {name} is a {architecture.probe} model"
    return None


def check_weightless(plan: ConversionPlan, read_small, *, folded_source: bool) -> None:
    """Every norm of the stream must be weightless (unit gain) once the plan has run: the refusal
    names the first that is not. A per-head q/k norm reads q_proj/k_proj's output, not the stream:
    a rotation changes only those projections' input side, so its gain stays."""
    for norm in plan.norms:
        if norm.baked_into is not None or norm.per_head:
            continue
        gain = f"{norm.name}.weight"
        if gain not in plan.tensors:
            if not norm.readers or not any(reader in plan.tensors for reader in norm.readers):
                raise NormswapError(f"cannot rotate: the norm {norm.name} has no reader in the checkpoint, so its "
                                    "output is a model output and would come out rotated")
            continue
        if folded_source:
            if not bool((read_small(plan.tensors[gain].source) == 1).all()):
                raise NormswapError(f"cannot rotate: the norm {norm.name} still has a gain (γ ≠ 1); RMSNorm(x·Q) = "
                                    "RMSNorm(x)·Q needs weightless norms")
        elif not norm.folded_gain:
            raise NormswapError(f"cannot rotate: the gain of the norm {norm.name} cannot be folded ({norm.note}); "
                                "RMSNorm(x·Q) = RMSNorm(x)·Q needs weightless norms")


def add_rotation(plan: ConversionPlan, architecture: Architecture, rotation: Rotation,
                 fixed: dict[str, str] | None = None) -> dict[str, int]:
    """Append a ``Rotate`` step to every tensor that writes or reads the stream; counts per side.

    Writers rotate along their hidden axis, readers along their input axis, kept norm biases as
    vectors (after β ⊘ γ is formed). A folded norm bias is zero and stays zero. Every rotated
    axis must have the stream's size d. Writers and norms of the ``fixed`` streams (name prefixes,
    ``in_fixed_stream``) are not rotated, nor per-head q/k norms: they normalise a head's slice of
    q_proj/k_proj's output, and the rotated reader computes the same output from the rotated
    stream ((x·Q)·(Qᵀ·W) = x·W, row vectors), so nothing they see changes.
    """
    d = rotation.dimension
    counts = {"writers": 0, "readers": 0, "norm_biases": 0}

    def rotate(name: str, axis: int, side: str, slice_wise: bool = True) -> None:
        tensor = plan.tensors[name]
        if tensor.shape[axis] != d:
            raise NormswapError(f"cannot rotate {name}: its stream axis has size {tensor.shape[axis]}, not {d}")
        if not tensor.dtype.is_floating_point:
            raise NormswapError(f"cannot rotate {name}: it is not a floating-point tensor")
        tensor.steps.append(Rotate(axis, side, rotation, slice_wise))
        counts[side + "s" if side != "norm_bias" else "norm_biases"] += 1

    for name in plan.tensors:
        writer = next((w for w in architecture.writers if re.fullmatch(w.pattern, name)), None)
        if writer is not None and not in_fixed_stream(name, fixed):
            rotate(name, writer.hidden_axis, "writer")
    for norm in plan.norms:
        if norm.baked_into is not None or norm.per_head or in_fixed_stream(norm.name, fixed):
            continue
        spec = next(s for s in architecture.norms if re.fullmatch(s.pattern, norm.name))
        groups = re.fullmatch(spec.pattern, norm.name).groupdict()
        for reader in spec.readers:
            weight = reader.weight.format(**groups)
            if weight in plan.tensors:
                rotate(weight, reader.input_axis, "reader")
        bias = f"{norm.name}.bias"
        if bias in plan.tensors and not norm.folded_bias:
            rotate(bias, 0, "norm_bias", slice_wise=False)
    return counts


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass
class RotationPlan:
    architecture: Architecture
    plan: ConversionPlan
    built: nn.Module | None  # the source's class on the meta device, when planning built it
    config: dict  # the source config as the original family describes it (model_type restored)
    folded_source: bool
    source_block: dict | None

    @property
    def meta(self) -> nn.Module:
        """The source's model class on the meta device, built at the first use: planning reads the
        adapter's declarations and builds it only where they are unsure."""
        if self.built is None:
            self.built = build.meta_model(self.config, self.architecture.auto_class)
        return self.built


def _original_config(config: dict) -> dict:
    """A normswap checkpoint's config as its original family's: model type restored, ours removed."""
    original = {key: value for key, value in config.items() if key not in ("normswap", "auto_map")}
    original["model_type"] = original_model_type(config)
    return original


def check_rotatable(source_dir: Path, config: dict) -> tuple[Architecture, dict, dict | None]:
    """The adapter, the family config and the source's normswap block; refusals before any weight is read."""
    provenance = Provenance.of(config, source_dir)
    if provenance is not None:
        options = provenance.options
        if provenance.slicing is not None:
            raise NormswapError(f"{source_dir} is already sliced (to {provenance.slicing.get('hidden_size')} "
                                "dimensions); rotate or slice the original instead")
        if provenance.rotation is not None:
            raise NormswapError(f"{source_dir} is already rotated ({provenance.rotation.get('method')}); "
                                "rotate the original or its folded conversion instead")
        if provenance.method != "exact":
            raise NormswapError(f"{source_dir} was converted with --method {options.get('method')}, which is "
                                "inexact; rotate the original instead")
        if not options.get("fold_gains"):
            raise NormswapError(f"{source_dir} was converted without --fold-gains, so its norms keep their gains; "
                                "rotate the original, or a conversion made with --fold-gains")
        config = _original_config(config)
    architecture = architecture_for(config)
    reason = refusal(architecture, config)
    if reason:
        raise NormswapError(f"cannot rotate this {config.get('model_type')} checkpoint exactly: {reason}")
    return architecture, config, None if provenance is None else provenance.block


def plan_rotation(source_dir: Path, config: dict, reader: CheckpointReader, *,
                  dtype: torch.dtype | None) -> RotationPlan:
    """The conversion plan (fold everything) of an original source, or the identity plan of a
    folded one, checked weightless; rotation steps are added later by ``add_rotation``."""
    architecture, family_config, block = check_rotatable(source_dir, config)
    if block is None:
        architecture, plan, meta = planning.plan_conversion(source_dir, config, reader, method="exact", fold_gains=True,
                                                            dtype=dtype, build_class=False)
    else:
        meta = build.meta_model(family_config, architecture.auto_class)
        structure = Structure.from_json(block.get("structure"))
        removed = set(structure.identity)
        # the folded checkpoint's writers are centred and its gains folded already: plan no step
        # but the rotation, and describe it with the structure it was written with
        names = ClassNames(
            # the modules the conversion made identities hold no weights in the folded checkpoint
            {key for key in meta.state_dict() if not any(key.startswith(f"{module}.") for module in removed)},
            [name for name in build.layer_norm_modules(meta) if name not in removed],
            meta.base_model_prefix, rename=build.checkpoint_renamer(meta))
        plan = build_plan(replace(architecture, bake=(), structure=lambda _config: {}), family_config, reader.tensors,
                          names, method="naive", fold_gains=False, dtype=dtype)
        plan.method = "exact"
        plan.structure = structure
    check_weightless(plan, reader.get, folded_source=block is not None)
    return RotationPlan(architecture, plan, meta, family_config, block is not None, block)


def hidden_size(meta: nn.Module) -> int:
    size = getattr(meta.config, "hidden_size", None)
    if not isinstance(size, int) or size <= 0:
        raise NormswapError("the model's config gives no hidden size")
    return size


# ---------------------------------------------------------------------------------------------
# The command


def family_of(source_dir: Path, config: dict) -> tuple[Architecture, dict, dict | None]:
    """The adapter of a rotation's source (an original or a folded conversion)."""
    if "normswap" in config:
        return architecture_for(_original_config(config)), _original_config(config), config["normswap"]
    return architecture_for(config), config, None


# ---------------------------------------------------------------------------------------------
# The commuting form: Q·1 = 1, the stock LayerNorm kept (``normswap.rotate.commuting``)


def in_fixed_stream(name: str, fixed: dict[str, str] | None) -> bool:
    """Whether ``name`` belongs to a stream the commuting form leaves as it is (a prefix of ``fixed``)."""
    return bool(fixed) and any(re.match(prefix, name) for prefix in fixed)


_CHOICE = re.compile(r"\((?:\?P<\w+>)?([^()]*)\)")


def _names_of(path: str) -> list[str]:
    """The module names a structure path (a ``pattern`` of literal names and ``(a|b)`` choices) stands for."""
    match = _CHOICE.search(path)
    if match is None:
        return [re.sub(r"\\(.)", r"\1", path)]
    return [name for choice in match.group(1).split("|")
            for name in _names_of(path[:match.start()] + choice + path[match.end():])]


def commuting_refusal(architecture: Architecture, config: dict) -> str | None:
    """Why the stock class cannot hold this family rotated, or None.

    Every write into a rotated stream must be a tensor Q can be folded into. A stream the adapter
    centres at run time (``centre_input``/``centre_output``: sinusoidal positions computed from
    the position, an embedding norm's output γ ⊙ LN(e) + β) or bakes (an embedding norm) receives a
    write that is no such tensor, so it must be one of the adapter's fixed streams."""
    fixed = architecture.fixed_streams(config)
    if "" in fixed:
        return f"{fixed['']}, so the stock class cannot hold its stream rotated"
    structure = Structure.from_json(architecture.structure(config))
    for kind, paths in (("centre_input", structure.centre_input), ("centre_output", structure.centre_output)):
        for path in paths:
            # a choice the class does not have (CLIPModel's bare ``pre_layrnorm``) is no write: the
            # path is refused only when none of its names lies in a fixed stream
            names = _names_of(path)
            outside = [name for name in names if not in_fixed_stream(name, fixed)]
            if len(outside) == len(names):
                return (f"a write into its stream at {outside[0]} is computed at run time or is a norm's output "
                        f"({kind}), not a tensor a rotation can be folded into")
    for norm in architecture.norms:
        # a model output no layer reads keeps its gain γ, and diag(γ) does not commute with Q; a
        # template with choices may name modules the class lacks, so only a single name is judged here
        outside = [name for name in _names_of(norm.pattern) if not in_fixed_stream(name, fixed)]
        if norm.output_is_model_output and not norm.readers and outside == [norm.module]:
            return (f"its final norm's output is a model output ({outside[0]} gives the last hidden state, and no "
                    "layer reads it to take its gain), so the output would come out rotated")
    for bake in architecture.bake:
        if not in_fixed_stream(bake.norm, fixed):
            return (f"its stream starts as {bake.norm}'s output γ ⊙ LN(e) + β, and diag(γ) does not commute "
                    "with Q")
    return None


def check_commuting(source_dir: Path, config: dict) -> Architecture:
    """The adapter of an original source the commuting form can rotate; refusals before any weight is read."""
    architecture = planning.check_convertible(source_dir, config)
    reason = commuting_refusal(architecture, config)
    if reason:
        hint = "" if refusal(architecture, config) else "; --form free writes a normswap_<type> checkpoint instead"
        raise NormswapError(f"cannot rotate this {config.get('model_type')} checkpoint with the stock class: "
                            f"{reason}{hint}")
    return architecture


def _folding_architecture(architecture: Architecture) -> Architecture:
    """The adapter as the commuting form plans it: no run-time centring (the stock class keeps
    LayerNorm, which removes the mean itself), and every norm folded, model outputs included (their
    output comes out rotated; ``Architecture.rotated_outputs`` says which)."""
    norms = tuple(replace(norm, output_is_model_output=False) for norm in architecture.norms)
    return replace(architecture, norms=norms, structure=lambda _config: {})


def plan_commuting(source_dir: Path, config: dict, reader: CheckpointReader, *,
                   dtype: torch.dtype | None) -> tuple[RotationPlan, dict[str, str]]:
    """The commuting form's plan of an original source: every norm outside the fixed streams
    folded into its readers (γ; β where the readers can take it, else β ⊘ γ kept), no writer
    centred, the fixed streams untouched; and the fixed streams. A folded conversion (already
    centred and weightless) is planned as for the free form."""
    if "normswap" in config:
        return plan_rotation(source_dir, config, reader, dtype=dtype), {}
    architecture = check_commuting(source_dir, config)
    fixed = architecture.fixed_streams(config)
    architecture, plan, meta = planning.plan_conversion(source_dir, config, reader, method="naive", fold_gains=True,
                                                        dtype=dtype, architecture=_folding_architecture(architecture),
                                                        build_class=False)
    plan.method = "exact"
    for name, tensor in plan.tensors.items():
        if in_fixed_stream(name, fixed):
            tensor.steps.clear()
    for norm in plan.norms:
        if in_fixed_stream(norm.name, fixed):
            norm.folded_gain = norm.folded_bias = False
            norm.kept_bias, norm.note = None, "not rotated: " + next(why for p, why in fixed.items() if re.match(p, norm.name))
        elif not norm.folded_gain and not norm.per_head and f"{norm.name}.weight" in plan.tensors:
            raise NormswapError(f"cannot rotate: the gain of the norm {norm.name} cannot be folded ({norm.note}); "
                                "LN(x·Q) = LN(x)·Q needs weightless norms")
    return RotationPlan(architecture, plan, meta, config, False, None), fixed


def stream_width(plan: ConversionPlan, architecture: Architecture, fixed: dict[str, str] | None) -> int:
    """d of the stream that rotates: the hidden-axis size of its first writer (CLIPModel's config
    states no single hidden size; the rotated tower's writers do)."""
    for name, tensor in plan.tensors.items():
        writer = next((w for w in architecture.writers if re.fullmatch(w.pattern, name)), None)
        if writer is not None and not in_fixed_stream(name, fixed):
            return tensor.shape[writer.hidden_axis]
    raise NormswapError("the checkpoint has no tensor that writes a rotatable stream")
