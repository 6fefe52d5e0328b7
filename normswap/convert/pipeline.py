"""The conversion pipeline: check → plan → write → verify → install, atomically.

``convert_checkpoint`` reads as the steps it takes; writing, verifying and installing are
``normswap.convert.install``'s, the lifecycle ``convert``, ``rotate`` and ``--slice`` share.
"""

from __future__ import annotations

from pathlib import Path

import torch

from normswap.arguments import checked
from normswap.checkpoint import output
from normswap.checkpoint.source import CheckpointReader, read_config, resolve_source, source_inputs
from normswap.convert import card, install
from normswap.convert.plan import ConversionPlan
from normswap.convert.planning import check_convertible, plan_conversion
from normswap.dtypes import dtype_name, parse_dtype
from normswap.errors import NormswapError


@checked
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
    verifier: install.Verifier | None = None,
) -> dict:
    """Convert the LayerNorm checkpoint ``src`` into an exact RMSNorm checkpoint at ``out``.

    Returns the provenance block written into ``out/config.json`` (with the verification
    figures). Raises ``NormswapError`` for bad input and ``VerificationError`` when the converted
    model does not match the original; in both cases nothing is left at ``out``.

    Tensors stream from the source shards to the output shards one group at a time, so memory is
    bounded by the largest tensor group, not the model. ``verification`` is ``auto`` (layer by
    layer for models too big to hold twice, else whole models), ``layerwise``, ``full`` or
    ``none``. A failure, a full disk or SIGINT/SIGTERM leaves nothing at ``out`` and no temporary
    directory. ``verifier`` (``normswap.verify.checkpoint.verify_checkpoint`` from the public API)
    checks the output unless ``verification`` is ``none``.
    """
    install.check_verification_mode(verification, atol, rtol)
    if method == "naive" and not allow_inexact:
        raise NormswapError("--method naive changes the model's outputs; pass --allow-inexact to accept that")
    out_dtype = parse_dtype(dtype)
    source_dir = resolve_source(src, trust_remote_code=trust_remote_code, revision=revision)
    out = output.absolute(out)
    inputs = source_inputs(source_dir)
    output.check_out(out, inputs, overwrite, kind="checkpoint")
    config = read_config(source_dir)
    architecture = check_convertible(source_dir, config)  # before reading any weights
    with CheckpointReader(source_dir) as reader:
        _, plan, meta = plan_conversion(source_dir, config, reader, architecture=architecture, method=method,
                                        fold_gains=fold_gains, dtype=out_dtype, build_class=False)
        options = {"method": method, "fold_gains": fold_gains, "dtype": dtype_name(main_dtype(plan))}
        provenance = card.provenance_block(str(src), plan, options, architecture.auto_class)
        if revision is not None:
            provenance["revision"] = revision
        files = install.OutputFiles(
            out, inputs, plan, provenance, overwrite=overwrite, quiet=quiet,
            config_json=lambda block: card.converted_config(config, plan, meta, architecture, block))
        check = install.OutputCheck(
            install.chosen_verifier(verification, verifier), must_pass=method == "exact",
            options={"atol": atol, "rtol": rtol, "layerwise": install.LAYERWISE[verification], "quiet": quiet,
                     "plan": plan})
        install.install(files, reader, source_dir, check)
    return provenance


def main_dtype(plan: ConversionPlan) -> torch.dtype:
    """The least precise floating dtype of the output: it sets the verification tolerance (a
    checkpoint mixing float16 and float32 tensors is as exact as its float16 ones)."""
    from normswap.dtypes import dtype_name, least_precise

    dtypes = {dtype_name(tensor.dtype) for tensor in plan.tensors.values() if tensor.dtype.is_floating_point}
    return getattr(torch, least_precise(dtypes))
