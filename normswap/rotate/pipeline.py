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
``normswap.rotate.calibration``'s. The output has its own model type ``normswap_<type>``: the stock
LayerNorm class would compute LayerNorm(x·Q), which is not LayerNorm(x)·Q.
"""

from __future__ import annotations

from pathlib import Path

import torch

from normswap.arguments import checked
from normswap.checkpoint import output
from normswap.checkpoint.source import CheckpointReader, read_config, resolve_source, source_inputs
from normswap.convert import card, install, pipeline
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError
from normswap.rotate.calibration import calibrate, read_calibration
from normswap.rotate.matrices import ROTATION_FILE, hadamard_rotation, orthogonal_rotation, save_rotation
from normswap.rotate.options import DEFAULT_CALIBRATION_TOKENS, METHODS
from normswap.rotate.plan import add_rotation, check_rotatable, hidden_size, plan_rotation


@checked
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
    verifier: install.Verifier | None = None,
) -> dict:
    """Write ``src`` with its residual basis rotated by Q to ``out``, verified against ``src``.

    ``src`` is an original LayerNorm checkpoint (centred and gain-folded in the same streaming
    pass) or a normswap checkpoint converted with ``--fold-gains``. ``method``: ``hadamard``,
    ``orthogonal`` (both seeded by ``seed``) or ``pca`` (needs ``calibration``, a text file).
    Returns the provenance block written into ``out/config.json``; raises ``NormswapError`` for bad
    input and ``VerificationError`` when the output does not match, leaving nothing at ``out``.
    ``verifier`` (``normswap.verify.checkpoint.verify_rotated`` from the public API) checks the
    output unless ``verification`` is ``none``.
    """
    check_options(method, seed, calibration, calibration_tokens, verification)
    install.check_verification_mode(verification, atol, rtol)
    out_dtype = parse_dtype(dtype)
    source_dir = resolve_source(src, trust_remote_code=trust_remote_code)
    out = output.absolute(out)
    inputs = source_inputs(source_dir) + ([Path(calibration)] if calibration is not None else [])
    output.check_out(out, inputs, overwrite, kind="checkpoint")
    config = read_config(source_dir)
    check_rotatable(source_dir, config)  # refusals before any weight is read
    if calibration is not None:
        read_calibration(calibration)
    with CheckpointReader(source_dir) as reader:
        rotation_plan = plan_rotation(source_dir, config, reader, dtype=out_dtype)
        if method == "pca":
            rotation = calibrate(source_dir, rotation_plan, calibration, calibration_tokens, config)
        else:
            make = hadamard_rotation if method == "hadamard" else orthogonal_rotation
            rotation = make(hidden_size(rotation_plan.meta), seed)
        counts = add_rotation(rotation_plan.plan, rotation_plan.architecture, rotation)
        plan, architecture = rotation_plan.plan, rotation_plan.architecture
        provenance = card.rotation_provenance(
            str(src), plan, architecture.auto_class, pipeline.main_dtype(plan),
            {**rotation.provenance(), "rotated": counts}, rotation_plan.source_block,
        )
        install.install(
            out, inputs, plan, reader, source_dir, provenance,
            config_json=lambda block: card.converted_config(rotation_plan.config, plan, rotation_plan.meta,
                                                            architecture, block),
            verifier=install.chosen_verifier(verification, verifier), must_pass=True,
            overwrite=overwrite, quiet=quiet, extra_files=lambda folder: save_rotation(folder / ROTATION_FILE, rotation),
            verify_options={"atol": atol, "rtol": rtol, "layerwise": install.LAYERWISE[verification], "quiet": quiet,
                            "reference_config": config, "plan": plan},
        )
    return provenance


def check_options(method: str, seed: int, calibration: str | Path | None, calibration_tokens: int,
                  verification: str) -> None:
    """Refuse inconsistent options in one line, before anything is read."""
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
    install.check_verification_mode(verification)
