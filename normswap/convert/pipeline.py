"""The conversion pipeline: check → plan → write → verify → install, atomically.

``convert_checkpoint`` reads as the steps it takes; writing, verifying and installing are
``normswap.convert.install``'s, the lifecycle ``convert``, ``rotate`` and ``--slice`` share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.checkpoint import output
from normswap.convert import card, install
from normswap.convert.plan import ConversionPlan
from normswap.convert.planning import check_convertible, plan_conversion
from normswap.dtypes import dtype_name, least_precise, parse_dtype
from normswap.errors import NormswapError
from normswap.runtime.checkpoint import Checkpoint


@dataclass(frozen=True)
class ConversionOptions:
    """What ``convert`` makes of its source: ``method`` ``exact`` (centre the writers) or ``naive``
    (swap only, which changes the outputs and needs ``allow_inexact``), ``fold_gains`` (γ and β
    into the readers) and the output ``dtype`` (None: the source's). Checked when made."""

    method: str = "exact"
    fold_gains: bool = False
    dtype: str | torch.dtype | None = None
    allow_inexact: bool = False

    def __post_init__(self) -> None:
        if self.method == "naive" and not self.allow_inexact:
            raise NormswapError("--method naive changes the model's outputs; pass --allow-inexact to accept that")
        parse_dtype(self.dtype)

    @property
    def out_dtype(self) -> torch.dtype | None:
        return parse_dtype(self.dtype)


def convert_checkpoint(source: Checkpoint, out: str | Path, options: ConversionOptions,
                       verification: install.Verification | None, *, overwrite: bool = False,
                       quiet: bool = True, verifier: install.Verifier | None = None,
                       prover: install.Prover | None = None) -> dict:
    """Convert the LayerNorm checkpoint ``source`` into an exact RMSNorm checkpoint at ``out``.

    Returns the provenance block written into ``out/config.json`` (with the verification
    figures). Raises ``NormswapError`` for bad input and ``VerificationError`` when the converted
    model does not match the original; in both cases nothing is left at ``out``.

    Tensors stream from the source shards to the output shards one group at a time, so memory is
    bounded by the largest tensor group, not the model. ``verification`` (None: none) says how
    ``verifier`` (``normswap.verify.checkpoint.verify_conversion`` from the public API) checks the
    output: layer by layer for models too big to hold twice, or whole models; ``prover``
    (``normswap.verify.proof.WrittenProof``) proves the weights as they are written, so that the
    source is read once. A failure, a full disk or SIGINT/SIGTERM leaves nothing at ``out`` and
    no temporary directory.
    """
    out = output.absolute(out)
    inputs = source.inputs()
    output.check_out(out, inputs, overwrite, kind="checkpoint")
    architecture = check_convertible(source.folder, source.config)  # before reading any weights
    method, fold_gains = options.method, options.fold_gains
    with source:
        _, plan, meta = plan_conversion(source.folder, source.config, source.reader, architecture=architecture,
                                        method=method, fold_gains=fold_gains, dtype=options.out_dtype,
                                        build_class=False)
        recorded = {"method": method, "fold_gains": fold_gains, "dtype": dtype_name(main_dtype(plan))}
        provenance = card.provenance_block(source.name, plan, recorded, architecture.auto_class)
        if source.revision is not None:
            provenance["revision"] = source.revision
        files = install.OutputFiles(
            out, inputs, plan, provenance, overwrite=overwrite, quiet=quiet,
            config_json=lambda block: card.converted_config(source.config, plan, meta, architecture, block))
        install.install(files, source.reader, source,
                        install.output_check(verification, verifier, must_pass=method == "exact", prover=prover))
    return provenance


def main_dtype(plan: ConversionPlan) -> torch.dtype:
    """The least precise floating dtype of the output: it sets the verification tolerance (a
    checkpoint mixing float16 and float32 tensors is as exact as its float16 ones)."""
    dtypes = {dtype_name(tensor.dtype) for tensor in plan.tensors.values() if tensor.dtype.is_floating_point}
    return getattr(torch, least_precise(dtypes))
