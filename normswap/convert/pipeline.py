"""The conversion pipeline: check → plan → write → verify → install, atomically.

``convert_checkpoint`` reads as the steps it takes. ``write_checkpoint`` is the part ``convert``
and ``rotate`` share: stream the weights into a temporary folder beside ``--out``, add the
modeling file, side files, config.json and card, verify, and install only after verification
passed (``normswap.output``), so a failed or interrupted run leaves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from normswap import card, output
from normswap.convert.plan import ConversionPlan
from normswap.convert.planning import check_convertible, plan_conversion
from normswap.convert.source import CheckpointReader, read_config, resolve_source, source_inputs
from normswap.convert.write import copy_side_files, write_json, write_weights
from normswap.dtypes import dtype_name, parse_dtype
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import MODELING_FILE, modeling_source

VERIFICATION_MODES = ("auto", "layerwise", "full", "none")
# --verify MODE as the verifier's ``layerwise`` (None: decided by the model's size)
LAYERWISE = {"auto": None, "layerwise": True, "full": False, "none": None}
Verifier = Callable[..., dict]


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    fold_gains: bool = False,
    method: str = "exact",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    allow_inexact: bool = False,
    quiet: bool = True,
    verification: str = "auto",
    revision: str | None = None,
) -> dict:
    """Convert the LayerNorm checkpoint ``src`` into an exact RMSNorm checkpoint at ``out``.

    Returns the provenance block written into ``out/config.json`` (with the verification
    figures). Raises ``NormswapError`` for bad input and ``VerificationError`` when the converted
    model does not match the original; in both cases nothing is left at ``out``.

    Tensors stream from the source shards to the output shards one group at a time, so memory is
    bounded by the largest tensor group, not the model. ``verification`` is ``auto`` (layer by
    layer for models too big to hold twice, else whole models), ``layerwise``, ``full`` or
    ``none``. A failure, a full disk or SIGINT/SIGTERM leaves nothing at ``out`` and no temporary
    directory.
    """
    check_verification_mode(verification, atol, rtol)
    if method == "naive" and not allow_inexact:
        raise NormswapError("--method naive changes the model's outputs; pass --allow-inexact to accept that")
    out_dtype = parse_dtype(dtype)
    source_dir = resolve_source(src, trust_remote_code=trust_remote_code, revision=revision)
    out = output.absolute(out)
    inputs = source_inputs(source_dir)
    output.check_out(out, inputs, overwrite)
    config = read_config(source_dir)
    architecture = check_convertible(source_dir, config)  # before reading any weights
    with CheckpointReader(source_dir) as reader:
        _, plan, meta = plan_conversion(source_dir, config, reader, architecture=architecture, method=method,
                                        fold_gains=fold_gains, dtype=out_dtype)
        options = {"method": method, "fold_gains": fold_gains, "dtype": dtype_name(main_dtype(plan))}
        provenance = card.provenance_block(str(src), plan, options, architecture.auto_class)
        if revision is not None:
            provenance["revision"] = revision
        from normswap.verify.checkpoint import verify_checkpoint

        write_checkpoint(
            out, inputs, plan, reader, source_dir, provenance,
            config_json=lambda block: card.converted_config(config, plan, meta, architecture, block),
            verifier=None if verification == "none" else verify_checkpoint,
            must_pass=method == "exact", overwrite=overwrite, quiet=quiet,
            verify_options={"atol": atol, "rtol": rtol, "layerwise": LAYERWISE[verification], "quiet": quiet,
                            "plan": plan},
        )
    return provenance


def check_verification_mode(verification: str, atol: float | None = None, rtol: float | None = None) -> None:
    """Refuse an unknown verification mode or an impossible tolerance before anything is read."""
    from normswap.verify import check_tolerance

    if verification not in VERIFICATION_MODES:
        raise NormswapError(f"unknown verification '{verification}'; use one of {', '.join(VERIFICATION_MODES)}")
    check_tolerance("atol", atol)
    check_tolerance("rtol", rtol)


def write_checkpoint(
    out: Path, inputs: list[Path], plan: ConversionPlan, reader: CheckpointReader, source_dir: Path | None,
    provenance: dict, *, config_json: Callable[[dict], dict], verifier: Verifier | None, must_pass: bool,
    overwrite: bool, quiet: bool, verify_options: dict, extra_files: Callable[[Path], None] | None = None,
) -> None:
    """Write ``plan``'s checkpoint beside ``out``, verify it, and install it at ``out``.

    ``config_json(provenance)`` is the config.json to write. It is written before verification,
    which loads the checkpoint from disk as a user would, and again with the figures
    (``provenance["verification"]``) once they are known. ``verifier(source_dir, folder,
    **verify_options)`` is ``verify_checkpoint`` or ``verify_rotated``; with ``must_pass`` a
    failed verification raises ``VerificationError`` and nothing is installed. ``source_dir``
    None (a model from memory) has no side files to copy and cannot be verified.
    """
    total = sum(tensor.nbytes for tensor in plan.tensors.values())
    output.check_free_space(out, total)
    with output.claimed_output(out, inputs=inputs, overwrite=overwrite, kind="checkpoint") as claim:
        tmp = claim.tmp
        with output.progress_bar(total, len(plan.tensors), quiet) as done:
            write_weights(tmp, plan, reader, done)
        reader.close()
        if extra_files is not None:
            extra_files(tmp)
        (tmp / MODELING_FILE).write_bytes(modeling_source())
        if source_dir is not None:  # tokenizer, processor and generation files
            copy_side_files(source_dir, tmp)
        write_json(tmp / "config.json", config_json(provenance))
        if verifier is not None:
            result = provenance["verification"] = verifier(source_dir, tmp, **verify_options)
            write_json(tmp / "config.json", config_json(provenance))
            if must_pass and not result["passed"]:
                raise VerificationError(_failure_line(result))
        (tmp / "README.md").write_text(card.model_card(provenance))
        claim.install()


def main_dtype(plan: ConversionPlan) -> torch.dtype:
    """The least precise floating dtype of the output: it sets the verification tolerance (a
    checkpoint mixing float16 and float32 tensors is as exact as its float16 ones)."""
    from normswap.verify.compare import default_tolerance

    dtypes = {tensor.dtype for tensor in plan.tensors.values() if tensor.dtype.is_floating_point}
    return max(dtypes, key=lambda dtype: default_tolerance(dtype), default=torch.float32)


def _failure_line(result: dict) -> str:
    worst = max(result["loaders"].items(), key=lambda item: item[1].get("max_abs_diff", 0.0))
    return (
        f"verification failed: {worst[0]} loader max |Δ| = {worst[1]['max_abs_diff']:.3g} exceeds "
        f"tolerance {result['tolerance']['limit']:.3g}; nothing was written"
    )
