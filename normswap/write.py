"""Write: execute a plan tensor by tensor into safetensors shards, plus the files around them.

Shards are streamed: each file's header is written first (every shape is known from the plan),
then each tensor is computed and written at its offset. Memory therefore holds one tensor and the
few it depends on, never a whole shard. Tensors are laid out in name order, so the same input
always gives byte-identical output.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from normswap import fold
from normswap.plan import Bake, Centre, ConversionPlan, DivideByGain, Fill, FoldBias, FoldGain, TensorPlan
from normswap.source import SAFETENSORS_DTYPE_NAMES, CheckpointReader

Read = Callable[[str], torch.Tensor]

# Files copied from the source checkpoint as they are (tokenizers, processors, generation).
COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.txt", "generation_config.json",
    "preprocessor_config.json", "processor_config.json", "feature_extractor_config.json",
    "normalizer.json", "chat_template.jinja", "chat_template.json",
)


def compute_tensor(plan: TensorPlan, read: Read) -> torch.Tensor:
    """The output value of one tensor: its source, transformed by its steps, in float64, cast once."""
    if plan.source is None:
        value = torch.zeros(plan.shape, dtype=torch.float64)
    else:
        value = read(plan.source)
    if not plan.steps:
        return value.to(plan.dtype)
    slice_steps = [step for step in plan.steps if step.slice_wise]
    other_steps = [step for step in plan.steps if not step.slice_wise]
    if slice_steps:
        axes = {step.axis for step in slice_steps}
        if len(axes) != 1:
            raise AssertionError(f"{plan.name}: slice-wise steps on different axes {axes}")
        transform = _compose([_slice_transform(step, read) for step in slice_steps])
        target = torch.float64 if other_steps else plan.dtype
        value = fold.chunked(value, transform, keep_axis=axes.pop(), out_dtype=target)
    for step in other_steps:
        value = _apply_whole(step, value.double(), read)
    return value.to(plan.dtype)


def _slice_transform(step, read: Read) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(step, Centre):
        return lambda x: fold.centre(x, step.axis)
    if isinstance(step, FoldGain):
        gain = read(step.gain)
        return lambda x: fold.fold_gain(x, gain, step.axis)
    if isinstance(step, Bake):
        gain, bias = read(step.gain), read(step.bias)
        return lambda x: fold.layer_norm_rows(x, gain, bias, step.eps)
    raise TypeError(step)


def _compose(transforms):
    def composed(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        for transform in transforms:
            x = transform(x)
        return x

    return composed


def _apply_whole(step, value: torch.Tensor, read: Read) -> torch.Tensor:
    if isinstance(step, Fill):
        return torch.full_like(value, step.value)
    if isinstance(step, DivideByGain):
        return fold.residual_norm_bias(read(step.gain), value)
    if isinstance(step, FoldBias):
        return fold.chunked_bias_fold(read(step.weight), read(step.norm_bias), value, step.axis)
    raise TypeError(step)


# ---------------------------------------------------------------------------------------------


def _header(plans: list[TensorPlan]) -> tuple[bytes, list[int]]:
    """A safetensors header for ``plans`` in order, and each tensor's data offset."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, position = [], 0
    for plan in plans:
        size = _nbytes(plan)
        header[plan.name] = {
            "dtype": SAFETENSORS_DTYPE_NAMES[plan.dtype],
            "shape": list(plan.shape),
            "data_offsets": [position, position + size],
        }
        offsets.append(position)
        position += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded, offsets


def _nbytes(plan: TensorPlan) -> int:
    count = 1
    for size in plan.shape:
        count *= size
    return count * torch.empty((), dtype=plan.dtype).element_size()


def write_shard(path: Path, plans: list[TensorPlan], read: Read, progress=None) -> int:
    """Stream ``plans`` into one safetensors file at ``path``; returns the bytes of tensor data."""
    header, offsets = _header(plans)
    with open(path, "wb") as file:
        file.write(header)
        for plan, offset in zip(plans, offsets, strict=True):
            value = compute_tensor(plan, read)
            if tuple(value.shape) != tuple(plan.shape):
                raise AssertionError(f"{plan.name}: computed shape {tuple(value.shape)} != {plan.shape}")
            file.seek(len(header) + offset)
            file.write(value.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if progress is not None:
                progress(_nbytes(plan))
        file.flush()
    return sum(_nbytes(plan) for plan in plans)


def write_weights(out_dir: Path, plan: ConversionPlan, reader: CheckpointReader, progress=None) -> None:
    """Every output shard, plus ``model.safetensors.index.json`` when there are several."""
    by_shard: dict[str, list[TensorPlan]] = {shard: [] for shard in plan.shards}
    for tensor in plan.tensors.values():
        by_shard[tensor.shard].append(tensor)
    total = 0
    for shard, tensors in by_shard.items():
        total += write_shard(out_dir / shard, tensors, reader.get, progress)
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: tensor.shard for name, tensor in plan.tensors.items()},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def copy_side_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Copy tokenizer, processor and generation files; returns their names."""
    copied = []
    for name in COPIED_FILES:
        if (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out_dir / name)
            copied.append(name)
    return copied


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
