"""The algebraic pre-check: cheap properties of the converted weights, checked before any model runs.

The conversion plan, rebuilt from the original with the options the conversion recorded, says how
each output tensor was made. Three kinds of tensor have a property that can be read off the
weights alone, without a forward pass:

* a centred writer (``Centre`` only): its mean along the hidden axis is zero, up to the rounding
  of the stored dtype;
* an untouched tensor (no step): the same bits as its source tensor (after the output's dtype
  cast, when the conversion changed the dtype);
* a folded reader (``FoldGain`` only): W·diag(γ), up to the rounding of the stored dtype.

Tensors made by other steps (baked embeddings, folded biases, rotations) are left to the model
comparison, which this check does not replace: it fails fast, naming the first tensor that is wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from normswap.convert.plan import Centre, FoldGain
from normswap.convert.source import CheckpointReader, read_config
from normswap.errors import VerificationError

CHUNK_BYTES = 16 << 20
# rounding to the stored dtype moves each value by at most half a unit in the last place
ROUNDING_UNITS = 2.0


def precheck(original_dir: Path, converted_dir: Path) -> dict:
    """Check every centred writer, untouched tensor and folded reader; counts of each checked.

    Raises ``VerificationError`` naming the first tensor that fails."""
    from normswap.convert.pipeline import plan_conversion

    options = (read_config(converted_dir).get("normswap") or {}).get("options", {})
    counts = {"centred": 0, "untouched": 0, "folded": 0, "left_to_models": 0}
    with CheckpointReader(original_dir) as source, CheckpointReader(converted_dir) as output:
        _, plan, _ = plan_conversion(original_dir, read_config(original_dir), source,
                                     method=options.get("method", "exact"),
                                     fold_gains=bool(options.get("fold_gains", False)), dtype=None)
        for name, tensor in plan.tensors.items():
            if name not in output.tensors or tensor.source is None:
                counts["left_to_models"] += 1
                continue
            kinds = [type(step) for step in tensor.steps]
            if not kinds:
                _check_untouched(source, output, tensor.source, name)
                counts["untouched"] += 1
            elif kinds == [Centre]:
                _check_centred(output, name, tensor.steps[0].axis)
                counts["centred"] += 1
            elif kinds == [FoldGain]:
                _check_folded(source, output, tensor.source, name, tensor.steps[0])
                counts["folded"] += 1
            else:
                counts["left_to_models"] += 1
    return counts


def _row_chunks(reader: CheckpointReader, name: str) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of ``name`` in slices of about CHUNK_BYTES, in the stored dtype."""
    info = reader.tensors[name]
    if len(info.shape) == 0 or info.shape[0] == 0:
        yield 0, reader.get(name)
        return
    row_bytes = max(1, info.nbytes // info.shape[0])
    rows = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, info.shape[0], rows):
        yield start, reader.read_rows(name, start, min(rows, info.shape[0] - start)).clone()


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _check_untouched(source: CheckpointReader, output: CheckpointReader, source_name: str, name: str) -> None:
    dtype = output.tensors[name].dtype
    if tuple(source.tensors[source_name].shape) != tuple(output.tensors[name].shape):
        raise VerificationError(f"pre-check: {name} should be {source_name} unchanged, but its shape differs")
    for (_, before), (_, after) in zip(_row_chunks(source, source_name), _row_chunks(output, name), strict=True):
        if not torch.equal(before.to(dtype), after):
            raise VerificationError(f"pre-check: {name} should be {source_name} unchanged, but its values differ")


def _check_centred(output: CheckpointReader, name: str, axis: int) -> None:
    """The mean along ``axis`` is zero up to the stored dtype's rounding of the largest value."""
    info = output.tensors[name]
    axis = axis % max(1, len(info.shape))
    total, largest = None, 0.0
    for _, rows in _row_chunks(output, name):
        rows64 = rows.double()
        largest = max(largest, float(rows64.abs().max()) if rows64.numel() else 0.0)
        if axis == 0:
            part = rows64.sum(0)
            total = part if total is None else total + part
        else:
            mean = rows64.mean(axis)
            _within(name, float(mean.abs().max()) if mean.numel() else 0.0, largest, info.dtype)
    if total is not None:
        _within(name, float((total / info.shape[0]).abs().max()), largest, info.dtype)


def _within(name: str, mean: float, largest: float, dtype: torch.dtype) -> None:
    if mean > ROUNDING_UNITS * _unit(dtype) * largest + 1e-30:
        raise VerificationError(f"pre-check: {name} is a centred writer, but its mean along the hidden axis is "
                                f"{mean:.3g} (largest value {largest:.3g})")


def _check_folded(source: CheckpointReader, output: CheckpointReader, source_name: str, name: str,
                  step: FoldGain) -> None:
    """The output equals W·diag(γ) along the step's axis, up to the stored dtype's rounding."""
    gain = source.get(step.gain).double()
    dtype = output.tensors[name].dtype
    unit = _unit(dtype)
    floor = torch.finfo(dtype).tiny * unit if dtype.is_floating_point else 0.0  # subnormal spacing
    ndim = len(output.tensors[name].shape)
    axis = step.axis % ndim
    for (start, before), (_, after) in zip(_row_chunks(source, source_name), _row_chunks(output, name), strict=True):
        if axis == 0:
            scale = gain[start: start + before.shape[0]].reshape(-1, *([1] * (ndim - 1)))
        else:
            scale = gain.reshape(*([1] * axis), -1, *([1] * (ndim - axis - 1)))
        expected = before.double() * scale
        error = (after.double() - expected).abs()
        if bool((error > ROUNDING_UNITS * unit * expected.abs() + floor).any()):
            raise VerificationError(f"pre-check: {name} should be {source_name} times the gain {step.gain}, "
                                    f"but it differs by up to {float(error.max()):.3g}")
