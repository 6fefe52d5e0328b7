"""``normswap rotate --slice``: write a sliced checkpoint and measure what slicing cost.

The math is in ``normswap.rotate.slicing``; this module plans (fold the source as ``rotate`` does,
calibrate block by block, choose the kept bases), writes the checkpoint through a claimed output
like every normswap command, and measures the perplexity of the original and of the written
sliced model on held-out text. A sliced model is not exact, so nothing is verified against a
tolerance: the perplexity cost is the figure, printed and recorded in the provenance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.architectures import Architecture
from normswap.checkpoint import output
from normswap.checkpoint.rotations import DEFAULT_CALIBRATION_TOKENS
from normswap.convert import card, install, pipeline
from normswap.convert.plan import ConversionPlan
from normswap.convert.write import Witness
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError
from normswap.evaluation.perplexity import strided_perplexity
from normswap.rotate import slicing
from normswap.rotate.calibration import (
    CALIBRATION_WINDOW,
    calibration_ids,
    calibration_moments,
    read_calibration,
)
from normswap.rotate.plan import RotationPlan, hidden_size, plan_rotation
from normswap.runtime.checkpoint import Checkpoint, checkpoint_of
from normswap.runtime.loaders import load_converted
from normswap.runtime.reference import reference_model
from normswap.threads import cpu_threads


@dataclass
class SlicePlan:
    """Everything the write needs: the folded plan, the kept bases and each tensor's role."""

    rotation_plan: RotationPlan
    layout: slicing.SliceLayout
    d: int
    k: int
    bases: list[torch.Tensor]
    roles: dict[str, slicing.Role]
    shortcuts: dict[str, torch.Tensor]
    block: dict  # provenance["slicing"]


@dataclass
class SliceTexts:
    """Calibration and held-out token ids, and what to record about them."""

    calibration: torch.Tensor
    held_out: torch.Tensor
    record: dict


def slice_texts(source_dir: Path, calibration: str | Path, held_out: str | Path | None, max_tokens: int) -> SliceTexts:

    text = read_calibration(calibration)
    ids = calibration_ids(source_dir, text, str(calibration))
    held_text = None if held_out is None else read_calibration(held_out)
    held_ids = None if held_text is None else calibration_ids(source_dir, held_text, str(held_out))
    calibration_part, held_part = slicing.split_held_out(ids, held_ids, max_tokens)
    record = {
        "calibration": {"text": Path(calibration).name, "text_sha256": slicing.text_sha256(text),
                        "tokens": int(calibration_part.numel())},
        "held_out": ({"text": Path(held_out).name, "text_sha256": slicing.text_sha256(held_text)}
                     if held_text is not None else {"text": f"the last tokens of {Path(calibration).name}"}),
    }
    record["held_out"]["tokens"] = int(held_part.numel())
    return SliceTexts(calibration_part, held_part, record)


def plan_slicing(source_dir: Path, rotation_plan: RotationPlan, architecture: Architecture,
                 layout: slicing.SliceLayout, fraction: float, texts: SliceTexts,
                 config: dict | None = None) -> SlicePlan:
    """Calibrate every signal block by block, keep k principal directions of each, assign roles."""

    d = hidden_size(rotation_plan.meta)
    k = slicing.kept_dimension(d, fraction)
    slicing.check_slice_inputs(fraction, d, k, texts.calibration.numel(), texts.held_out.numel())
    n_blocks = len(rotation_plan.meta.get_submodule(layout.blocks))
    norms = slicing.signal_norms(layout, n_blocks)
    measured = calibration_moments(source_dir, architecture, norms, texts.calibration, CALIBRATION_WINDOW, config)
    bases, kept = slicing.kept_bases(measured.moments, norms, k)
    for head, embedding in architecture.tied:
        if head not in rotation_plan.plan.tensors:  # a tied head would read the last signal in the first's basis
            raise NormswapError(f"cannot slice: {head} stays tied to {embedding}, and slicing gives them different bases")
    roles = slicing.tensor_roles(list(rotation_plan.plan.tensors), architecture, layout, norms)
    block = slicing.slicing_block(layout, roles, fraction, d, k, kept)
    block.update(texts.record)
    block["calibration"].update(window=measured.window, measured=measured.mode)
    shortcuts = slicing.shortcut_tensors(layout, bases, n_blocks)
    return SlicePlan(rotation_plan, layout, d, k, bases, roles, shortcuts, block)


def perplexity_cost(source_dir: Path, sliced_dir: Path, architecture: Architecture, ids: torch.Tensor,
                    window: int, source_config: dict | None = None) -> dict:
    """Perplexity of the original and of the sliced model on ``ids`` (windows of ``window``, no overlap)."""

    figures: dict = {}
    loaders = (("original", lambda: reference_model(source_dir, architecture, config=source_config)),
               ("sliced", lambda: load_converted(sliced_dir, "rmsnorm")))
    for label, load in loaders:
        model = load()
        with cpu_threads(1):  # one thread: the same inputs give the same figures, bit for bit
            result = strided_perplexity(model, ids, max_length=window, stride=window)
        figures[label] = result.token_perplexity
        del model
    figures.update(tokens=int(ids.numel()), window=window, increase=figures["sliced"] / figures["original"] - 1)
    return figures


def sliced_config(slice_plan: SlicePlan, provenance: dict) -> dict:
    """config.json: the rotated-checkpoint config, with ε·d/k for the norms over k dimensions."""
    rotation_plan = slice_plan.rotation_plan
    config = card.converted_config(rotation_plan.config, rotation_plan.plan, rotation_plan.meta,
                                   rotation_plan.architecture, provenance)
    key = slice_plan.layout.eps_key
    config[key] = float(config[key]) * slice_plan.d / slice_plan.k
    return config


def model_card(provenance: dict, fields: dict[str, str]) -> str:
    block = provenance["slicing"]
    cost = block.get("perplexity", {})
    figures = (f" Perplexity on {cost['tokens']} held-out tokens: {cost['original']:.4g} (original) → "
               f"{cost['sliced']:.4g} (sliced)." if cost else "")
    return card.model_card(provenance, fields) + (
        "\n## Slicing\n\n"
        f"The residual stream was cut from {block['original_hidden_size']} to {block['hidden_size']} dimensions "
        f"(fraction {block['fraction']}): at every norm input the least-variance principal directions of the "
        "stream on the calibration text were deleted, and every residual path carries a shortcut matrix "
        "(`shortcut_<branch>.weight`) that changes basis between norm inputs. The model is NOT exact: it "
        f"approximates the original.{figures} Load it with `trust_remote_code=True` or `normswap.load`.\n"
    )


@dataclass(frozen=True)
class SliceOptions:
    """What ``rotate --slice`` makes of its source: the ``fraction`` of the stream's dimensions
    deleted (0 < f < 1; ``allow_zero`` admits 0, which keeps every dimension and is exact), the
    ``calibration`` text its principal directions are measured on (at most ``calibration_tokens``
    of it), the ``held_out`` text the perplexity cost is measured on (None: the calibration
    text's last tokens) and the output ``dtype`` (None: the source's). Checked when made."""

    fraction: float
    calibration: str | Path | None
    held_out: str | Path | None = None
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    dtype: str | torch.dtype | None = None
    allow_zero: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", slicing.check_fraction(self.fraction, allow_zero=self.allow_zero))
        if self.calibration is None:
            raise NormswapError("--slice needs --calibration TEXT_FILE: the stream's principal directions are "
                                "measured on it")
        if self.calibration_tokens < 2:
            raise NormswapError("--calibration-tokens must be at least 2")
        parse_dtype(self.dtype)

    def texts(self) -> list[Path]:
        """The text files read, which the output may not hold."""
        return [Path(self.calibration), *([Path(self.held_out)] if self.held_out else [])]


def slice_checkpoint(source: str | Path | Checkpoint, out: str | Path, options: SliceOptions, *,
                     overwrite: bool = False, trust_remote_code: bool = False, quiet: bool = True,
                     prover: install.Prover | None = None) -> dict:
    """Write ``source`` sliced as ``options`` say to ``out``; returns the provenance block,
    perplexity cost included.

    ``prover(plan)`` (``normswap.verify.proof.WrittenProof``, passed in by the command) proves
    every tensor against the sliced plan as it is written, before the perplexity is measured;
    its figures are recorded as ``slicing.proof``."""

    source = checkpoint_of(source, trust_remote_code=trust_remote_code)
    out = output.absolute(out)
    inputs = [*source.inputs(), *options.texts()]
    output.check_out(out, inputs, overwrite, kind="checkpoint")
    source_dir, config = source.folder, source.config
    architecture, layout = slicing.check_sliceable(source_dir, config)
    texts = slice_texts(source_dir, options.calibration, options.held_out, options.calibration_tokens)
    with source:
        rotation_plan = plan_rotation(source_dir, config, source.reader, dtype=parse_dtype(options.dtype))
        slice_plan = plan_slicing(source_dir, rotation_plan, architecture, layout, options.fraction, texts, config)
        plan = rotation_plan.plan
        dtype_out = pipeline.main_dtype(plan)
        provenance = card.rotation_provenance(source.name, plan, architecture.auto_class, dtype_out, {},
                                              rotation_plan.source_block)
        del provenance["rotation"]  # the source's block for a checkpoint in a new basis; the basis is sliced
        provenance["slicing"] = slice_plan.block
        sliced = slicing.sliced_plan(plan, slice_plan.roles, slice_plan.bases, slice_plan.shortcuts, dtype_out,
                                     slice_plan.d)
        cost = _perplexity_measure(architecture, texts.held_out, slice_plan.block["calibration"]["window"],
                                   lambda figures: slice_plan.block.update(proof=figures))
        files = install.OutputFiles(out, inputs, sliced, provenance, overwrite=overwrite, quiet=quiet,
                                    config_json=lambda block: sliced_config(slice_plan, block), model_card=model_card)
        install.install(files, source.reader, source, install.OutputCheck(cost, records_as=("slicing", "perplexity"),
                                                                         prover=prover))
    return provenance


def _perplexity_measure(architecture: Architecture, ids: torch.Tensor, window: int,
                        record_proof: Callable[[dict], None]) -> install.Verifier:
    """The install lifecycle's check for a sliced checkpoint: the figures of the weights proof
    taken while it was written (``written``, when there is one) to ``record_proof``, then its
    perplexity cost, which must be finite."""
    def measure(source: Checkpoint, folder: Path, verification: install.Verification, plan: ConversionPlan,
                written: Witness | None) -> dict:
        if written is not None:
            record_proof(written.figures(folder))
        cost = perplexity_cost(source.folder, folder, architecture, ids, window, source.config)
        if not all(math.isfinite(cost[label]) for label in ("original", "sliced")):
            raise NormswapError(f"the sliced model's perplexity is not finite ({cost['sliced']}); nothing was written")
        return cost

    return measure
