"""The one lifecycle of every command that writes a checkpoint: write → verify → install.

``install`` streams the planned weights into a temporary folder beside ``--out``, adds the
modeling file, side files, config.json and model card, runs the verifier it is given, and
installs the folder only after verification passed (``normswap.checkpoint.output``), so a failed
or interrupted run leaves nothing. ``convert``, ``rotate`` and ``--slice`` all write through it;
the verifier is passed in, so this layer never imports ``normswap.verify``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from normswap.checkpoint import output
from normswap.checkpoint.source import CheckpointReader
from normswap.convert import card
from normswap.convert.plan import ConversionPlan
from normswap.convert.write import Witness, copy_side_files, write_json, write_weights
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import MODELING_FILE, modeling_source
from normswap.runtime.checkpoint import Checkpoint

VERIFICATION_MODES = ("auto", "layerwise", "full", "none")
# --verify MODE as the verifier's ``layerwise`` (None: decided by the model's size)
LAYERWISE = {"auto": None, "layerwise": True, "full": False, "none": None}


@dataclass(frozen=True)
class Verification:
    """How a written checkpoint is checked against its source: the tolerance (None: the stored
    dtype's default), ``layerwise`` (True: block by block; False: whole models; None: chosen by
    size), whether progress is shown, whether the checkpoint's own modeling file runs
    (``trust_remote_code``) and whether every tensor is proven first (``proof``)."""

    atol: float | None = None
    rtol: float | None = None
    layerwise: bool | None = None
    quiet: bool = True
    trust_remote_code: bool = False
    proof: bool = True

    @classmethod
    def of_mode(cls, mode: str, atol: float | None = None, rtol: float | None = None,
                quiet: bool = True) -> Verification:
        """The verification ``--verify mode`` asks for, its mode and tolerance checked first."""
        check_verification_mode(mode, atol, rtol)
        return cls(atol=atol, rtol=rtol, layerwise=LAYERWISE[mode], quiet=quiet)


# verifier(source, folder, verification, plan, written) -> figures: ``verify_conversion``,
# ``verify_rotation`` or a sliced model's perplexity cost; ``plan`` is the plan the folder was
# written from, ``written`` the witness that proved its weights as they were written (or None)
Verifier = Callable[[Checkpoint, Path, Verification, ConversionPlan, "Witness | None"], dict]
# prover(plan) -> the witness that proves a plan's weights while they are written
# (``normswap.verify.proof.WrittenProof``), so that the source is read once
Prover = Callable[[ConversionPlan], Witness]


def check_verification_mode(verification: str, atol: float | None = None, rtol: float | None = None) -> None:
    """Refuse an unknown verification mode or an impossible tolerance before anything is read."""
    if verification not in VERIFICATION_MODES:
        raise NormswapError(f"unknown verification '{verification}'; use one of {', '.join(VERIFICATION_MODES)}")
    check_tolerance("atol", atol)
    check_tolerance("rtol", rtol)


def check_tolerance(name: str, value: object) -> None:
    """``atol`` / ``rtol`` as the Python API takes them: None (the dtype's default) or a finite
    number >= 0. NaN would make every comparison fail and a negative bound could never pass."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise NormswapError(f"{name} must be a finite number >= 0, not {value!r:.30}")


def requested(mode: str, atol: float | None = None, rtol: float | None = None,
              quiet: bool = True) -> Verification | None:
    """The verification ``--verify mode`` asks for (None for ``none``), checked before anything is read."""
    verification = Verification.of_mode(mode, atol, rtol, quiet)
    return None if mode == "none" else verification


def output_check(verification: Verification | None, verifier: Verifier | None, must_pass: bool,
                 prover: Prover | None = None) -> OutputCheck:
    """The check of an output: ``verifier`` with ``verification`` (its weights proven while they
    are written when there is a ``prover`` and the verification proves them), or none when none
    is asked for."""
    if verification is None:
        return OutputCheck()
    if verifier is None:
        raise TypeError("a verification needs a verifier (normswap.api passes one)")
    return OutputCheck(verifier, must_pass=must_pass, verification=verification,
                       prover=prover if verification.proof else None)


@dataclass
class OutputFiles:
    """What one install writes at ``out``: ``plan``'s weights, ``extra_files(folder)``'s files,
    the config.json ``config_json(provenance)``, the source's side files and the model card
    ``model_card(provenance, fields)`` (``fields``: the hub's card fields, ``card.hub_fields``).
    ``inputs`` are the files the command read, which ``out`` may not hold."""

    out: Path
    inputs: list[Path]
    plan: ConversionPlan
    provenance: dict
    config_json: Callable[[dict], dict]
    overwrite: bool = False
    quiet: bool = False
    extra_files: Callable[[Path], None] | None = None
    model_card: Callable[[dict, dict], str] = card.model_card


@dataclass
class OutputCheck:
    """How an output is checked before it is installed: ``verifier(source, folder, verification,
    plan, written)`` (``verify_conversion``, ``verify_rotation``, a sliced model's perplexity cost;
    None: no check), whose figures are recorded in the provenance under the keys ``records_as``;
    with ``must_pass`` a failed check raises ``VerificationError`` and nothing is installed.
    ``prover(plan)`` makes the witness that proves the weights as they are written (``written``)."""

    verifier: Verifier | None = None
    must_pass: bool = False
    verification: Verification = field(default_factory=Verification)
    records_as: tuple[str, ...] = ("verification",)
    prover: Prover | None = None


def install(files: OutputFiles, reader: CheckpointReader, source: Checkpoint | None,
            check: OutputCheck | None = None) -> None:
    """Write ``files`` beside their ``out`` from ``reader``, check them, and install them at ``out``.

    config.json is written before the check, which loads the checkpoint from disk as a user
    would, and again with the figures once they are known. ``source`` None (a model from
    memory) has no side files to copy and cannot be verified.
    """
    check = check or OutputCheck()
    plan, provenance, config_json = files.plan, files.provenance, files.config_json
    total = sum(tensor.nbytes for tensor in plan.tensors.values())
    output.check_free_space(files.out, total)
    with output.claimed_output(files.out, inputs=files.inputs, overwrite=files.overwrite, kind="checkpoint") as claim:
        tmp = claim.tmp
        written = None if check.verifier is None or check.prover is None else check.prover(plan)
        with output.progress_bar(total, len(plan.tensors), files.quiet) as done:
            write_weights(tmp, plan, reader, done, witness=written)
        reader.close()
        if files.extra_files is not None:
            files.extra_files(tmp)
        if config_json(provenance).get("auto_map"):  # only a config that names its classes loads the file
            (tmp / MODELING_FILE).write_bytes(modeling_source())
        source_dir = None if source is None else source.folder
        if source_dir is not None:  # tokenizer, processor and generation files
            copy_side_files(source_dir, tmp)
        write_json(tmp / "config.json", config_json(provenance))
        if check.verifier is not None:
            result = check.verifier(source, tmp, check.verification, plan, written)
            *parents, key = check.records_as
            block = provenance
            for parent in parents:
                block = block[parent]
            block[key] = result
            write_json(tmp / "config.json", config_json(provenance))
            if check.must_pass and not result["passed"]:
                raise VerificationError(_failure_line(result))
        fields = card.hub_fields(provenance, config_json(provenance), source_dir)
        (tmp / "README.md").write_text(files.model_card(provenance, fields))
        claim.install()


def _failure_line(result: dict) -> str:
    worst = max(result["loaders"].items(), key=lambda item: item[1].get("max_abs_diff", 0.0))
    return (
        f"verification failed: {worst[0]} loader max |Δ| = {worst[1]['max_abs_diff']:.3g} exceeds "
        f"tolerance {result['tolerance']['limit']:.3g}; nothing was written"
    )
