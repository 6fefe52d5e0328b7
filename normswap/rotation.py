"""Rotated checkpoints: the residual basis turned by an orthogonal Q, exactly.

A LayerNorm model becomes rotatable once every norm is weightless: ``convert --fold-gains``
centres every write (LayerNorm = RMSNorm) and folds every γ (and β where a reader can take it)
into the readers. Then RMSNorm(x·Q) = RMSNorm(x)·Q, and rotating every writer's output side,
every reader's input side and every kept norm bias by Q leaves the function unchanged
(``normswap.convert.fold`` has the identities). The stream the model carries is x·Q.

The rotation is one more step per tensor in the conversion plan (``plan.Rotate``), so a rotated
checkpoint is written by the same streaming writer as ``convert``, in the same pass as the
centring and folding when the source is an original checkpoint. Which tensors rotate comes from
the adapters alone: every ``Writer`` on its hidden axis, every ``Reader`` of a norm on its input
axis, every norm bias that is kept.

Q is ``hadamard`` (diag(±1)·H/√d, H from ``normswap.hadamard``), ``orthogonal`` (seeded Haar),
or ``pca`` (the principal directions of the stream on calibration text). The output has its own
model type ``normswap_<type>``: the stock LayerNorm class would compute LayerNorm(x·Q), which is
not LayerNorm(x)·Q. Q itself is saved beside the weights (``normswap_rotation.safetensors``) so
that the checkpoint can be verified, its activations mapped back (x = x'·Qᵀ), or the rotation
undone.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from normswap import __version__, hadamard, output
from normswap.architectures import Architecture, architecture_for
from normswap.convert import fold
from normswap.convert.plan import ConversionPlan, Rotate, build_plan
from normswap.convert.source import CheckpointReader, read_config, resolve_source
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import build, remote
from normswap.verify import compare as verify

METHODS = ("hadamard", "orthogonal", "pca")
ROTATION_FILE = "normswap_rotation.safetensors"
# calibration: at most this many tokens, in windows of at most this many positions
DEFAULT_CALIBRATION_TOKENS = 32768
CALIBRATION_WINDOW = 512


@dataclass(frozen=True, eq=False)
class Rotation:
    """An orthogonal d×d matrix (float64) and how it was made."""

    method: str
    seed: int | None
    matrix: torch.Tensor
    construction: str
    calibration: dict | None = None

    @property
    def dimension(self) -> int:
        return self.matrix.shape[0]

    @property
    def sha256(self) -> str:
        """Hash of Q's float64 little-endian bytes, row-major."""
        return hashlib.sha256(self.matrix.contiguous().numpy().tobytes()).hexdigest()

    def provenance(self) -> dict:
        block = {"method": self.method, "seed": self.seed, "dimension": self.dimension,
                 "construction": self.construction, "matrix_sha256": self.sha256, "matrix_file": ROTATION_FILE}
        if self.calibration is not None:
            block["calibration"] = self.calibration
        return block


def hadamard_rotation(d: int, seed: int) -> Rotation:
    """Q = diag(s)·H/√d with a Hadamard H of order d and seeded signs s (``fold.randomised_hadamard``)."""
    construction = hadamard.describe(d)
    if construction is None:
        raise NormswapError(
            f"no Hadamard matrix of order {d} is constructible here (Sylvester, prime-order Paley and their "
            "Kronecker products); use --method orthogonal"
        )
    matrix = fold.randomised_hadamard(hadamard.hadamard_matrix(d), seed)
    return Rotation("hadamard", seed, matrix, f"diag(±1)·H/√d, H = {construction}")


def orthogonal_rotation(d: int, seed: int) -> Rotation:
    return Rotation("orthogonal", seed, fold.random_orthogonal(d, seed), "QR of a seeded Gaussian, sign-fixed")


def pca_rotation(second_moment: torch.Tensor, calibration: dict) -> Rotation:
    matrix, values = fold.principal_rotation(second_moment)
    total = float(values.clamp(min=0).sum())
    share = values.clamp(min=0).cumsum(0) / total if total > 0 else values
    kept = {f"top_{k}": float(share[k - 1]) for k in (1, 8, 32) if k <= values.numel()}
    return Rotation("pca", None, matrix, "eigenvectors of Σ xᵀx over the calibration stream, by decreasing variance",
                    {**calibration, "energy_share": kept})


def save_rotation(path: Path, rotation: Rotation) -> None:
    from safetensors.torch import save_file

    # no metadata: safetensors writes a metadata map in no fixed order, and the file must be
    # byte-identical across rebuilds (config.json records the method and the hash)
    save_file({"rotation": rotation.matrix.contiguous()}, str(path))
    path.chmod(0o644)  # as the weights: readable like the rest of the checkpoint


def load_rotation(checkpoint: Path, dimension: int | None = None) -> torch.Tensor:
    """Q of a rotated checkpoint, checked before use: a float64 ``dimension``-square matrix,
    orthogonal (|QᵀQ - I| < 1e-9), whose hash is the one its provenance records."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    block = read_config(checkpoint).get("normswap", {}).get("rotation")
    if block is None:
        raise NormswapError(f"{checkpoint} is not a rotated normswap checkpoint")
    if not isinstance(block, dict) or not isinstance(block.get("matrix_sha256"), str):
        raise NormswapError(f"{checkpoint}/config.json: normswap.rotation must be a mapping with a matrix_sha256")
    file = checkpoint / ROTATION_FILE
    if not file.is_file():
        raise NormswapError(f"{checkpoint} lacks {ROTATION_FILE}, the rotation it was made with")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as error:
        raise NormswapError(f"{file} is not a readable safetensors file ({error})") from None
    matrix = tensors.get("rotation")
    if matrix is None or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or not matrix.is_floating_point():
        raise NormswapError(f"{file} must hold one square floating tensor named 'rotation'")
    matrix = matrix.double()
    if dimension is not None and matrix.shape[0] != dimension:
        raise NormswapError(f"{file} is {matrix.shape[0]}x{matrix.shape[0]}, but the model's stream has {dimension} dimensions")
    if hashlib.sha256(matrix.contiguous().numpy().tobytes()).hexdigest() != block["matrix_sha256"]:
        raise NormswapError(f"{file} does not match the rotation hash recorded in config.json")
    error = float((matrix.T @ matrix - torch.eye(matrix.shape[0], dtype=torch.float64)).abs().max())
    if not error < 1e-9:
        raise NormswapError(f"{file} is not orthogonal (max |QᵀQ - I| = {error:.3g}); it is not a rotation")
    return matrix


# ---------------------------------------------------------------------------------------------
# What can be rotated


def refusal(architecture: Architecture, config: dict) -> str | None:
    """Why a family (as configured) cannot be rotated exactly, or None."""
    name = config.get("model_type")
    structure = architecture.structure(config)
    for kind in ("centre_input", "centre_output"):
        if structure.get(kind):
            return (f"{name} centres part of its stream at run time ({kind}); mean removal along 1 does not "
                    "commute with a rotation, so those norms cannot be made rotation-invariant")
    for norm in architecture.norms:
        if norm.output_is_model_output:
            return (f"the norm {norm.pattern.replace(chr(92), '')} outputs a model output ({name}'s last "
                    "hidden state): its gains cannot be folded and the output would come out rotated")
    if architecture.probe != "causal_lm":
        return f"rotation covers decoder-only language models; {name} is a {architecture.probe} model"
    return None


def check_weightless(plan: ConversionPlan, read_small, *, folded_source: bool) -> None:
    """Every norm must be weightless (unit gain) once the plan has run: the refusal names the first that is not."""
    for norm in plan.norms:
        if norm.baked_into is not None:
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


def add_rotation(plan: ConversionPlan, architecture: Architecture, rotation: Rotation) -> dict[str, int]:
    """Append a ``Rotate`` step to every tensor that writes or reads the stream; counts per side.

    Writers rotate along their hidden axis, readers along their input axis, kept norm biases as
    vectors (after β ⊘ γ is formed). A folded norm bias is zero and stays zero. Every rotated
    axis must have the stream's size d.
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
        if writer is not None:
            rotate(name, writer.hidden_axis, "writer")
    for norm in plan.norms:
        if norm.baked_into is not None:
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
    meta: nn.Module
    config: dict  # the source config as the original family describes it (model_type restored)
    folded_source: bool
    source_block: dict | None


def _original_config(config: dict) -> dict:
    """A normswap checkpoint's config as its original family's: model type restored, ours removed."""
    block = config["normswap"]
    original = {key: value for key, value in config.items() if key not in ("normswap", "auto_map")}
    original["model_type"] = block.get("original_model_type", config.get("model_type"))
    return original


def check_source(source_dir: Path, config: dict) -> tuple[Architecture, dict, dict | None]:
    """The adapter, the family config and the source's normswap block; refusals before any weight is read."""
    block = config.get("normswap")
    if block is not None:
        options = block.get("options", {})
        if "rotation" in block:
            raise NormswapError(f"{source_dir} is already rotated ({block['rotation'].get('method')}); "
                                "rotate the original or its folded conversion instead")
        if options.get("method", "exact") != "exact":
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
    return architecture, config, block


def plan_rotation(source_dir: Path, config: dict, reader: CheckpointReader, *,
                  dtype: torch.dtype | None) -> RotationPlan:
    """The conversion plan (fold everything) of an original source, or the identity plan of a
    folded one, checked weightless; rotation steps are added later by ``add_rotation``."""
    from normswap.convert.pipeline import plan_conversion

    architecture, family_config, block = check_source(source_dir, config)
    if block is None:
        architecture, plan, meta = plan_conversion(source_dir, config, reader, method="exact", fold_gains=True,
                                                   dtype=dtype)
    else:
        meta = build.meta_model(family_config, architecture.auto_class)
        structure = block.get("structure") or {}
        removed = set(structure.get("identity", []))
        # the folded checkpoint's writers are centred and its gains folded already: plan no step
        # but the rotation, and describe it with the structure it was written with
        plan = build_plan(
            replace(architecture, bake=(), structure=lambda _config: {}), family_config, reader.tensors,
            model_keys=set(meta.state_dict().keys()),
            layer_norm_modules=[name for name in build.layer_norm_modules(meta) if name not in removed],
            base_prefix=meta.base_model_prefix, method="naive", fold_gains=False, dtype=dtype,
            rename=build.checkpoint_renamer(meta),
        )
        plan.method = "exact"
        plan.structure = {key: list(value) for key, value in structure.items()}
    check_weightless(plan, reader.get, folded_source=block is not None)
    return RotationPlan(architecture, plan, meta, family_config, block is not None, block)


def hidden_size(meta: nn.Module) -> int:
    size = getattr(meta.config, "hidden_size", None)
    if not isinstance(size, int) or size <= 0:
        raise NormswapError("the model's config gives no hidden size")
    return size


# ---------------------------------------------------------------------------------------------
# Calibration (pca)


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


def calibrate(source_dir: Path, rotation_plan: RotationPlan, text_path: str | Path, max_tokens: int) -> Rotation:
    """The pca rotation of the source's stream on the calibration text: Σ over every norm of its
    input's second moment, measured block by block (``normswap.calibration``)."""
    from normswap.calibration import calibration_ids, calibration_moments

    text = read_calibration(text_path)
    ids = calibration_ids(source_dir, text, str(text_path))[:max_tokens]
    norms = [norm.name for norm in rotation_plan.plan.norms if norm.baked_into is None]
    measured = calibration_moments(source_dir, rotation_plan.architecture, norms, ids, CALIBRATION_WINDOW)
    moment = sum(measured.moments[name] for name in norms)
    calibration = {"text": Path(text_path).name, "tokens": int(ids.numel()),
                   "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "window": measured.window}
    return pca_rotation(moment, calibration)


# ---------------------------------------------------------------------------------------------
# Output


def rotated_config(rotation_plan: RotationPlan, provenance: dict) -> dict:
    """config.json of the output: as ``convert`` writes it, under the model type normswap_<type>."""
    from normswap.convert.pipeline import converted_config

    new = converted_config(rotation_plan.config, rotation_plan.plan, rotation_plan.meta,
                           rotation_plan.architecture, provenance)
    original_type = rotation_plan.config["model_type"]
    new["model_type"] = remote.MODEL_TYPE_PREFIX + original_type
    model_name = type(rotation_plan.meta).__name__
    autos = [name for name in new["auto_map"] if name != "AutoConfig"]
    new["auto_map"] = {
        "AutoConfig": f"modeling_normswap.{remote.CLASS_PREFIX}{type(rotation_plan.meta.config).__name__}",
        **{auto: f"modeling_normswap.{remote.OWN_TYPE_PREFIX}{model_name}" for auto in autos},
    }
    return new


def rotation_provenance(src: str, rotation_plan: RotationPlan, rotation: Rotation, counts: dict,
                        checkpoint_dtype: torch.dtype) -> dict:
    block = source_provenance(src, rotation_plan, checkpoint_dtype)
    block["rotation"] = {**rotation.provenance(), "rotated": counts}
    return block


def source_provenance(src: str, rotation_plan: RotationPlan, checkpoint_dtype: torch.dtype) -> dict:
    """The provenance block of a checkpoint made from ``rotation_plan`` (folded, not stock-loadable)."""
    from normswap.convert.pipeline import provenance_block

    plan = rotation_plan.plan
    dtype_name = str(checkpoint_dtype).removeprefix("torch.")
    if rotation_plan.folded_source:
        block = {key: value for key, value in rotation_plan.source_block.items() if key != "verification"}
        block.update({"version": __version__, "rotated_from": src})
        block["options"] = {**block.get("options", {}), "dtype": dtype_name}
    else:
        options = {"method": "exact", "fold_gains": True, "dtype": dtype_name}
        block = provenance_block(src, plan, options, rotation_plan.architecture.auto_class)
    block["stock_loadable"] = False
    return block


def rotate_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    method: str = "hadamard",
    seed: int = 0,
    calibration: str | Path | None = None,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    verification: str = "auto",
    quiet: bool = True,
) -> dict:
    """Write ``src`` with its residual basis rotated by Q to ``out``, verified against ``src``.

    ``src`` is an original LayerNorm checkpoint (centred and gain-folded in the same streaming
    pass) or a normswap checkpoint converted with ``--fold-gains``. ``method``: ``hadamard``,
    ``orthogonal`` (both seeded by ``seed``) or ``pca`` (needs ``calibration``, a text file).
    Returns the provenance block written into ``out/config.json``; raises ``NormswapError`` for bad
    input and ``VerificationError`` when the output does not match, leaving nothing at ``out``.
    """
    from normswap.convert import pipeline
    from normswap.convert.pipeline import source_inputs
    from normswap.convert.write import copy_side_files, write_json, write_weights

    if method not in METHODS:
        raise NormswapError(f"unknown rotation method '{method}'; use one of {', '.join(METHODS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise NormswapError(f"--seed must be an integer from 0 to 2**63 - 1, not {seed!r:.30}")
    if method == "pca" and calibration is None:
        raise NormswapError("--method pca needs --calibration TEXT_FILE: the stream's principal directions are measured on it")
    if method != "pca" and calibration is not None:
        raise NormswapError(f"--calibration is only used by --method pca, not {method}")
    if calibration_tokens < 2:
        raise NormswapError("--calibration-tokens must be at least 2")
    if verification not in pipeline.VERIFICATION_MODES:
        raise NormswapError(f"unknown verification '{verification}'; use one of {', '.join(pipeline.VERIFICATION_MODES)}")
    out_dtype = pipeline.parse_dtype(dtype)
    source_dir = resolve_source(src, trust_remote_code=trust_remote_code)
    out = output.absolute(out)
    inputs = source_inputs(source_dir) + ([Path(calibration)] if calibration is not None else [])
    output.check_out(out, inputs, overwrite)
    config = read_config(source_dir)
    check_source(source_dir, config)  # refusals before any weight is read
    if calibration is not None:
        read_calibration(calibration)
    with CheckpointReader(source_dir) as reader:
        rotation_plan = plan_rotation(source_dir, config, reader, dtype=out_dtype)
        d = hidden_size(rotation_plan.meta)
        if method == "hadamard":
            rotation = hadamard_rotation(d, seed)
        elif method == "orthogonal":
            rotation = orthogonal_rotation(d, seed)
        else:
            rotation = calibrate(source_dir, rotation_plan, calibration, calibration_tokens)
        counts = add_rotation(rotation_plan.plan, rotation_plan.architecture, rotation)
        checkpoint_dtype = pipeline._main_dtype(rotation_plan.plan)
        provenance = rotation_provenance(str(src), rotation_plan, rotation, counts, checkpoint_dtype)
        pipeline._check_free_space(out, rotation_plan.plan)
        with output.claimed_output(out, inputs=inputs, overwrite=overwrite, kind="checkpoint") as claim:
            tmp = claim.tmp
            progress = None if quiet else pipeline._progress_bar(rotation_plan.plan)
            write_weights(tmp, rotation_plan.plan, reader, progress)
            if progress is not None:
                progress.close()
            reader.close()
            save_rotation(tmp / ROTATION_FILE, rotation)
            (tmp / pipeline.MODELING_FILE).write_bytes(pipeline.modeling_source())
            copy_side_files(source_dir, tmp)
            write_json(tmp / "config.json", rotated_config(rotation_plan, provenance))
            if verification != "none":
                default_atol, default_rtol = verify.default_tolerance(checkpoint_dtype)
                from normswap.verify.rotated import verify_rotated

                result = verify_rotated(
                    source_dir, tmp,
                    atol=default_atol if atol is None else atol,
                    rtol=default_rtol if rtol is None else rtol,
                    layerwise={"auto": None, "layerwise": True, "full": False}[verification],
                    quiet=quiet,
                )
                provenance["verification"] = result
                write_json(tmp / "config.json", rotated_config(rotation_plan, provenance))
                if not result["passed"]:
                    raise VerificationError(pipeline._failure_line(result))
            (tmp / "README.md").write_text(model_card(provenance))
            claim.install()
    return provenance


def model_card(provenance: dict) -> str:
    """The converted checkpoint's card, with a section on the rotation."""
    from normswap.convert.pipeline import model_card as conversion_card

    rotation = provenance["rotation"]
    seed = "" if rotation["seed"] is None else f", seed {rotation['seed']}"
    section = (
        "\n## Rotation\n\n"
        f"The residual stream is rotated by an orthogonal matrix Q ({rotation['method']}{seed}; "
        f"{rotation['construction']}; d = {rotation['dimension']}; sha256 {rotation['matrix_sha256']}), "
        f"stored in `{ROTATION_FILE}`. Every writer, reader and kept norm bias was rotated, so the model "
        "computes the original's function while its hidden states are x·Q. Load it with "
        "`trust_remote_code=True` or `normswap.load`; stock LayerNorm classes refuse it on purpose, "
        "because LayerNorm(x·Q) ≠ LayerNorm(x)·Q.\n"
    )
    return conversion_card(provenance) + section


def _family(source_dir: Path, config: dict) -> tuple[Architecture, dict, dict | None]:
    """The adapter of a rotation's source (an original or a folded conversion)."""
    if "normswap" in config:
        return architecture_for(_original_config(config)), _original_config(config), config["normswap"]
    return architecture_for(config), config, None
