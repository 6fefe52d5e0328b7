"""Rotated checkpoints: the residual basis turned by an orthogonal Q, exactly.

A LayerNorm model becomes rotatable once every norm is weightless: ``convert --fold-gains``
centres every write (LayerNorm = RMSNorm) and folds every γ (and β where a reader can take it)
into the readers. Then RMSNorm(x·Q) = RMSNorm(x)·Q, and rotating every writer's output side,
every reader's input side and every kept norm bias by Q leaves the function unchanged
(``normswap.convert.fold`` has the identities). The stream the model carries is x·Q.

The rotation is one more step per tensor in the conversion plan (``Rotate``), so a rotated
checkpoint is written by the same streaming writer, and installed by the same
``pipeline.write_checkpoint``, as ``convert``, in the same pass as the centring and folding when
the source is an original checkpoint. Which tensors rotate comes from the adapters alone: every
``Writer`` on its hidden axis, every ``Reader`` of a norm on its input axis, every norm bias that
is kept. The matrices are ``normswap.rotate.matrices``'s, the pca calibration
``normswap.rotate.calibration``'s.

Two forms. ``commuting`` (the default): Q·1 = 1 (``normswap.rotate.commuting``), so
LN(x·Q) = LN(x)·Q with the stock LayerNorm itself; the norms are folded but no writer is centred,
and the output keeps the original model type: stock transformers loads it. ``free``: any
orthogonal Q on the centred, RMSNorm-exact conversion; the output has its own model type
``normswap_<type>``, because the stock LayerNorm class would compute LayerNorm(x·Q) ≠ LayerNorm(x)·Q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.checkpoint import output
from normswap.checkpoint.rotations import (
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_FORM,
    DEFAULT_METHOD,
    ROTATION_FORMS,
    ROTATION_METHODS,
    rotation_method,
)
from normswap.checkpoint.source import CheckpointReader
from normswap.convert import card, install, pipeline
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError
from normswap.rotate import commuting, matrices
from normswap.rotate.calibration import MediaCalibration, calibrate, read_calibration, reads_text
from normswap.rotate.matrices import ROTATION_FILE, Rotation, save_rotation
from normswap.rotate.online import add_online_hadamard
from normswap.rotate.plan import (
    RotationPlan,
    add_rotation,
    check_commuting,
    check_rotatable,
    plan_commuting,
    plan_rotation,
    stream_width,
)
from normswap.runtime.checkpoint import Checkpoint


@dataclass(frozen=True)
class RotationOptions:
    """What ``rotate`` makes of its source: Q by ``method`` (``hadamard`` and ``orthogonal`` seeded
    by ``seed``; ``pca`` measured on ``calibration`` over ``calibration_tokens`` positions) in
    ``form`` (``commuting``: Q·1 = 1, stock model type; ``free``: ``normswap_<type>``), stored in
    ``dtype`` (None: the source's), and with ``online_hadamard`` (free form only) H at every MLP
    down projection's input, at run time. Checked, in one line, when made."""

    method: str = DEFAULT_METHOD
    seed: int = 0
    form: str = DEFAULT_FORM
    calibration: str | Path | None = None
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    dtype: str | torch.dtype | None = None
    online_hadamard: bool = False

    def __post_init__(self) -> None:
        check_options(self)
        parse_dtype(self.dtype)

    @property
    def out_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.dtype)


def rotate_checkpoint(source: Checkpoint, out: str | Path, options: RotationOptions,
                      verification: install.Verification | None, *, overwrite: bool = False, quiet: bool = True,
                      verifier: install.Verifier | None = None, media: MediaCalibration | None = None,
                      prover: install.Prover | None = None) -> dict:
    """Write ``source`` with its residual basis rotated by Q to ``out``, verified against it.

    ``source`` is an original LayerNorm checkpoint (folded, and for the free form centred, in the
    same streaming pass) or a normswap checkpoint converted with ``--fold-gains``. A pca
    calibration of a Whisper or ViT model is what ``media`` reads
    (``normswap.evaluation.calibration`` from the API). Returns the provenance block written into
    ``out/config.json``; raises ``NormswapError`` for bad input and ``VerificationError`` when the
    output does not match, leaving nothing at ``out``. ``verifier``
    (``normswap.verify.checkpoint.verify_rotation`` from the public API) checks the output as
    ``verification`` asks (None: not at all); ``prover`` proves the weights as they are written.
    """
    out, config = output.absolute(out), source.config
    calibration = check_source(source.folder, config, options.form, options.calibration, media)
    read_files = [Path(calibration)] if calibration is not None and Path(calibration).exists() else []
    inputs = source.inputs() + read_files
    output.check_out(out, inputs, overwrite, kind="checkpoint")
    with source:
        rotation_plan, fixed = planned_rotation(source.folder, config, source.reader, options.form, options.out_dtype)
        rotation = make_rotation(options, source, rotation_plan, calibration, fixed, media)
        block = rotated_block(rotation, options.form, rotation_plan, fixed, options.online_hadamard)
        plan, architecture = rotation_plan.plan, rotation_plan.architecture
        provenance = card.rotation_provenance(source.name, plan, architecture.auto_class, pipeline.main_dtype(plan),
                                              block, rotation_plan.source_block)
        files = install.OutputFiles(
            out, inputs, plan, provenance, overwrite=overwrite, quiet=quiet,
            config_json=lambda block: card.converted_config(rotation_plan.config, plan, rotation_plan.built,
                                                            architecture, block),
            extra_files=lambda folder: save_rotation(folder / ROTATION_FILE, rotation))
        install.install(files, source.reader, source, install.output_check(verification, verifier, must_pass=True,
                                                                         prover=prover))
    return provenance


def rotated_block(rotation: Rotation, form: str, rotation_plan: RotationPlan, fixed: dict[str, str],
                  online_hadamard: bool) -> dict:
    """Add the ``Rotate`` steps (and with ``online_hadamard`` the down projections' H) to the
    plan; the provenance block of the rotation."""
    counts = add_rotation(rotation_plan.plan, rotation_plan.architecture, rotation, fixed)
    block = {**rotation.provenance(), **form_provenance(form, rotation_plan, fixed), "rotated": counts}
    if online_hadamard:
        block["online_hadamard"] = add_online_hadamard(rotation_plan.plan, rotation_plan.architecture,
                                                       rotation_plan.meta)
    return block


def check_source(source_dir: Path, config: dict, form: str, calibration: str | Path | None,
                 media: MediaCalibration | None = None) -> str | Path | None:
    """The refusals of a source (and its calibration inputs) in ``form``, before any weight is
    read; the calibration inputs as resolved (``bundled`` named by ``media``)."""
    architecture = check_rotatable(source_dir, config)[0] if form == "free" or "normswap" in config \
        else check_commuting(source_dir, config)
    if calibration is None:
        return None
    if media is not None:
        calibration = media.resolve(config, str(calibration))
    if reads_text(architecture, config):
        read_calibration(calibration, 1 << 12)  # its first characters: found, UTF-8, not empty
    return calibration


def make_rotation(options: RotationOptions, source: Checkpoint, rotation_plan: RotationPlan,
                  calibration: str | Path | None, fixed: dict[str, str] | None = None,
                  media: MediaCalibration | None = None) -> Rotation:
    """Q of ``options.method`` in ``options.form``, of the stream's size; pca measured on the
    ``calibration`` inputs (text, or what ``media`` reads for a model of audio or images, as
    ``check_source`` resolved them) over the rotated stream."""
    method, form = options.method, options.form
    if ROTATION_METHODS[method].calibrated:
        return calibrate(source.folder, rotation_plan, calibration, options.calibration_tokens, source.config,
                         make=construction(method, form), fixed=fixed, media=media)
    d = stream_width(rotation_plan.plan, rotation_plan.architecture, fixed or {})
    return seeded_rotation(method, form, d, options.seed)


# the module holding each form's constructions, one per method under its ``builder`` name
FORM_MODULES = {"commuting": commuting, "free": matrices}


def construction(method: str, form: str) -> Callable[..., Rotation]:
    """The function that makes ``method``'s Q in ``form``: of (order, seed) for a seeded method,
    of (second moment, calibration record) for a calibrated one."""
    return getattr(FORM_MODULES[form], ROTATION_METHODS[method].builder)


def seeded_rotation(method: str, form: str, d: int, seed: int) -> Rotation:
    """The Q of a seeded ``method`` of order d and ``seed`` in ``form`` (the weights proof
    rebuilds a stored Q with it)."""
    return construction(method, form)(d, seed)


def planned_rotation(source_dir: Path, config: dict, reader: CheckpointReader, form: str,
                     dtype: torch.dtype | None) -> tuple[RotationPlan, dict[str, str]]:
    """The plan of a rotation in ``form`` before its ``Rotate`` steps, and the streams it leaves
    as they are (``add_rotation`` takes both; the weights proof rebuilds a rotation's plan with it)."""
    if form == "commuting":
        return plan_commuting(source_dir, config, reader, dtype=dtype)
    return plan_rotation(source_dir, config, reader, dtype=dtype), {}


def form_provenance(form: str, rotation_plan: RotationPlan, fixed: dict[str, str]) -> dict:
    """What the provenance records of the form: which, whether the stream is centred (then the
    RMSNorm class computes the model too), the streams left as they are, the outputs that come out
    rotated (``output = ((h - β) ⊘ γ)·Q``, or (h ⊘ γ)·Q where β ⊘ γ stayed in the norm)."""
    block = {"form": form, "centred": form == "free" or rotation_plan.folded_source}
    if form == "commuting":
        block["fixed_streams"] = dict(fixed)
        block["rotated_outputs"] = rotation_plan.architecture.rotated_outputs(rotation_plan.config)
    return block


def check_options(options: RotationOptions) -> None:
    """Refuse inconsistent options in one line, before anything is read."""
    method, seed, calibration = options.method, options.seed, options.calibration
    if options.form not in ROTATION_FORMS:
        raise NormswapError(f"unknown rotation form '{options.form}'; use one of {', '.join(ROTATION_FORMS)}")
    if options.online_hadamard and options.form != "free":
        raise NormswapError("--online-hadamard needs --form free: H is applied at run time to the MLP down "
                            "projection's input, which follows the non-linearity, so no weight can hold it and the "
                            "stock class has no place for it")
    record = rotation_method(method)
    if record is None:
        raise NormswapError(f"unknown rotation method '{method}'; use one of {', '.join(ROTATION_METHODS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise NormswapError(f"--seed must be an integer from 0 to 2**63 - 1, not {seed!r:.30}")
    if record.calibrated and calibration is None:
        raise NormswapError(f"--method {method} needs --calibration TEXT_FILE: its Q is measured on it")
    if record.seeded and calibration is not None:
        calibrated = ", ".join(name for name, each in ROTATION_METHODS.items() if each.calibrated)
        raise NormswapError(f"--calibration is only used by a measured rotation (--method {calibrated}), not {method}")
    if options.calibration_tokens < 2:
        raise NormswapError("--calibration-tokens must be at least 2")
