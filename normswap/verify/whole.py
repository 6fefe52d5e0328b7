"""Whole-model comparison: the reference and each load of the converted checkpoint, one at a time,
in float32, on one probe."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from normswap.architectures import Architecture
from normswap.memory import release_memory
from normswap.runtime.loaders import each_loader, load_converted
from normswap.threads import on_idle_cores
from normswap.verify.compare import compare_outputs, model_output
from normswap.verify.probes import LOGIT_PROBES, Probe, build_probe


@on_idle_cores
def compare_whole(reference: Callable[[], nn.Module], reference_dir: Path, converted_dir: Path,
                  architecture: Architecture, *, stock_loadable: bool, rms_how: str | None,
                  converted_config: dict | None = None, skip: frozenset[str] = frozenset(),
                  ) -> tuple[Probe, dict[str, dict]]:
    """The probe, and the figures of each load of ``converted_dir`` against the model
    ``reference()`` builds (the original, or the checkpoint a rotation started from).
    ``converted_config``: the converted checkpoint's config.json, when the caller has read it; the
    outputs named in ``skip`` (a rotation's rotated outputs) are not compared."""
    model = reference()
    probe = build_probe(architecture.probe, model.config, reference_dir)
    expected = model_output(model, probe, architecture.probe, skip)
    del model
    release_memory()
    labels = probe.inputs.get("input_ids") if architecture.probe == "causal_lm" else None
    loaders = {}
    for label, model in each_loader(stock_loadable, rms_how,
                                    lambda how: load_converted(converted_dir, how, config=converted_config)):
        candidate = model_output(model, probe, architecture.probe, skip)
        del model
        loaders[label] = compare_outputs(expected, candidate, distribution=architecture.probe in LOGIT_PROBES,
                                         labels=labels)
    return probe, loaders
