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

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from normswap.checkpoint.source import CheckpointReader, read_config
from normswap.convert.plan import ConversionPlan
from normswap.convert.steps import Centre, FoldGain
from normswap.errors import NormswapError, VerificationError
from normswap.memory import release_memory

CHUNK_BYTES = 16 << 20
# rounding to the stored dtype moves each value by at most half a unit in the last place
ROUNDING_UNITS = 2.0


def precheck(original_dir: Path, converted_dir: Path, plan: ConversionPlan | None = None) -> dict:
    """Check every centred writer, untouched tensor and folded reader; counts of each checked.

    ``plan`` is the plan the conversion ran, when the caller has it; else it is rebuilt from the
    original with the options the conversion recorded. Raises ``VerificationError`` naming the
    first tensor that fails."""
    from normswap.convert.planning import plan_conversion

    options = (read_config(converted_dir).get("normswap") or {}).get("options", {})
    counts = {"centred": 0, "untouched": 0, "folded": 0, "left_to_models": 0}
    rebuilt = plan is None
    with CheckpointReader(original_dir) as source, CheckpointReader(converted_dir) as output:
        if plan is None:
            _, plan, _ = plan_conversion(original_dir, read_config(original_dir), source,
                                         method=options.get("method", "exact"),
                                         fold_gains=bool(options.get("fold_gains", False)), dtype=None)
        for name, tensor in plan.tensors.items():
            if name not in output.tensors or tensor.source is None:
                counts["left_to_models"] += 1
                continue
            if tuple(output.tensors[name].shape) != tuple(tensor.shape):
                raise VerificationError(f"{converted_dir}: {name} has shape {list(output.tensors[name].shape)}; "
                                        f"the conversion makes it {list(tensor.shape)}")
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
    if rebuilt:  # the plan's meta model is garbage now: hand its memory back before the models run
        del plan
        release_memory()
    return counts


def _row_chunks(reader: CheckpointReader, name: str, buffer: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of ``name`` in slices of at most CHUNK_BYTES, in the stored dtype, read
    into ``buffer`` (each slice is overwritten by the next)."""
    info = reader.tensors[name]
    if len(info.shape) == 0 or info.shape[0] == 0:
        yield 0, reader.get(name)
        return
    rows = max(1, CHUNK_BYTES // max(1, info.nbytes // info.shape[0]))
    for start in range(0, info.shape[0], rows):
        yield start, reader.read_rows(name, start, min(rows, info.shape[0] - start), buffer)


def _buffer() -> torch.Tensor:
    return torch.empty(CHUNK_BYTES, dtype=torch.uint8)


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Sums of 16-bit values are exact enough in float32 for a bound in their own rounding unit."""
    return torch.float32 if dtype.itemsize <= 2 else torch.float64


def _check_untouched(source: CheckpointReader, output: CheckpointReader, source_name: str, name: str) -> None:
    dtype = output.tensors[name].dtype
    if tuple(source.tensors[source_name].shape) != tuple(output.tensors[name].shape):
        raise VerificationError(f"pre-check: {name} should be {source_name} unchanged, but its shape differs")
    same_dtype = source.tensors[source_name].dtype == dtype
    chunks = zip(_row_chunks(source, source_name, _buffer()), _row_chunks(output, name, _buffer()), strict=True)
    for (_, before), (_, after) in chunks:
        if same_dtype and before.is_contiguous() and after.is_contiguous():
            equal = torch.equal(_words(before), _words(after))
        else:
            equal = torch.equal(before.to(dtype), after)
        if not equal:
            raise VerificationError(f"pre-check: {name} should be {source_name} unchanged, but its values differ")


def _words(values: torch.Tensor) -> torch.Tensor:
    """The bytes of ``values`` as 8-byte words where they divide evenly (compared 4x faster than bytes)."""
    raw = values.reshape(-1).view(torch.uint8)
    return raw.view(torch.int64) if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0 else raw


def _check_centred(output: CheckpointReader, name: str, axis: int) -> None:
    """The mean along ``axis`` is zero up to the stored dtype's rounding of the largest value."""
    info = output.tensors[name]
    axis = axis % max(1, len(info.shape))
    accumulate = _accumulator(info.dtype)
    total, largest, worst = None, 0.0, 0.0
    for _, rows in _row_chunks(output, name, _buffer()):
        if rows.numel() == 0:
            continue
        low, high = torch.aminmax(rows)
        largest = max(largest, -float(low), float(high))
        part = rows.to(accumulate).sum(axis)  # converting first is faster than summing 16-bit values
        if axis == 0:
            total = part if total is None else total + part
        else:
            worst = max(worst, float(part.abs().max()) / info.shape[axis])
    if total is not None:
        worst = float(total.abs().max()) / info.shape[0]
    if not math.isfinite(worst) or not math.isfinite(largest):
        _refuse_non_finite(output, name)
    _within(name, worst, largest, info.dtype)


def _refuse_non_finite(output: CheckpointReader, name: str) -> None:
    raise NormswapError(f"the converted checkpoint {output.path} has NaN or infinite values in tensor {name}; "
                        "its outputs cannot be compared")


def _within(name: str, mean: float, largest: float, dtype: torch.dtype) -> None:
    if mean > ROUNDING_UNITS * _unit(dtype) * largest + 1e-30:
        raise VerificationError(f"pre-check: {name} is a centred writer, but its mean along the hidden axis is "
                                f"{mean:.3g} (largest value {largest:.3g})")


def _check_folded(source: CheckpointReader, output: CheckpointReader, source_name: str, name: str,
                  step: FoldGain) -> None:
    """The output equals W·diag(γ) along the step's axis, up to the stored dtype's rounding."""
    gain = source.get(step.gain).double() + step.offset
    dtype = output.tensors[name].dtype
    unit = _unit(dtype)
    floor = torch.finfo(dtype).tiny * unit if dtype.is_floating_point else 0.0  # subnormal spacing
    ndim = len(output.tensors[name].shape)
    axis = step.axis % ndim
    chunks = zip(_row_chunks(source, source_name, _buffer()), _row_chunks(output, name, _buffer()), strict=True)
    for (start, before), (_, after) in chunks:
        if axis == 0:
            scale = gain[start: start + before.shape[0]].reshape(-1, *([1] * (ndim - 1)))
        else:
            scale = gain.reshape(*([1] * axis), -1, *([1] * (ndim - axis - 1)))
        if not bool(torch.isfinite(after).all()):
            _refuse_non_finite(output, name)
        expected = before.double() * scale
        error = (after.double() - expected).abs()
        if bool((error > ROUNDING_UNITS * unit * expected.abs() + floor).any()):
            raise VerificationError(f"pre-check: {name} should be {source_name} times the gain {step.gain}, "
                                    f"but it differs by up to {float(error.max()):.3g}")
