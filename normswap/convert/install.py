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
from pathlib import Path

from normswap.checkpoint import output
from normswap.checkpoint.source import CheckpointReader
from normswap.convert import card
from normswap.convert.plan import ConversionPlan
from normswap.convert.write import copy_side_files, write_json, write_weights
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import MODELING_FILE, modeling_source

VERIFICATION_MODES = ("auto", "layerwise", "full", "none")
# --verify MODE as the verifier's ``layerwise`` (None: decided by the model's size)
LAYERWISE = {"auto": None, "layerwise": True, "full": False, "none": None}
Verifier = Callable[..., dict]


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


def chosen_verifier(verification: str, verifier: Verifier | None) -> Verifier | None:
    """The verifier to run for ``--verify verification``: none for ``none``, else ``verifier``."""
    if verification == "none":
        return None
    if verifier is None:
        raise TypeError(f"verification {verification!r} needs a verifier (normswap.api passes one)")
    return verifier


def install(
    out: Path, inputs: list[Path], plan: ConversionPlan, reader: CheckpointReader, source_dir: Path | None,
    provenance: dict, *, config_json: Callable[[dict], dict], verifier: Verifier | None, must_pass: bool,
    overwrite: bool, quiet: bool, verify_options: dict, extra_files: Callable[[Path], None] | None = None,
    records_as: tuple[str, ...] = ("verification",), model_card: Callable[[dict, dict], str] = card.model_card,
) -> None:
    """Write ``plan``'s checkpoint beside ``out``, verify it, and install it at ``out``.

    ``config_json(provenance)`` is the config.json to write. It is written before verification,
    which loads the checkpoint from disk as a user would, and again with the figures
    (``provenance["verification"]``) once they are known. ``verifier(source_dir, folder,
    **verify_options)`` is ``verify_checkpoint`` or ``verify_rotated``; with ``must_pass`` a
    failed verification raises ``VerificationError`` and nothing is installed. ``source_dir``
    None (a model from memory) has no side files to copy and cannot be verified. The verifier's
    figures are recorded in the provenance under the keys ``records_as``; the card is
    ``model_card(provenance, fields)``, ``fields`` the hub's card fields (``card.hub_fields``).
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
        if config_json(provenance).get("auto_map"):  # only a config that names its classes loads the file
            (tmp / MODELING_FILE).write_bytes(modeling_source())
        if source_dir is not None:  # tokenizer, processor and generation files
            copy_side_files(source_dir, tmp)
        write_json(tmp / "config.json", config_json(provenance))
        if verifier is not None:
            result = verifier(source_dir, tmp, **verify_options)
            *parents, key = records_as
            block = provenance
            for parent in parents:
                block = block[parent]
            block[key] = result
            write_json(tmp / "config.json", config_json(provenance))
            if must_pass and not result["passed"]:
                raise VerificationError(_failure_line(result))
        fields = card.hub_fields(provenance, config_json(provenance), source_dir)
        (tmp / "README.md").write_text(model_card(provenance, fields))
        claim.install()


def _failure_line(result: dict) -> str:
    worst = max(result["loaders"].items(), key=lambda item: item[1].get("max_abs_diff", 0.0))
    return (
        f"verification failed: {worst[0]} loader max |Δ| = {worst[1]['max_abs_diff']:.3g} exceeds "
        f"tolerance {result['tolerance']['limit']:.3g}; nothing was written"
    )
