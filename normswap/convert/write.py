"""Write: execute a plan tensor by tensor into safetensors shards, plus the files around them.

Shards are streamed: each file's header is written first (every shape is known from the plan),
then each tensor is computed and written at its offset. Memory therefore holds one tensor group
(a tensor and the few it depends on: a reader weight for a bias fold, a norm gain), never a whole
shard, and peak memory does not grow with the number of layers. Tensors are laid out in name
order and the header is serialised deterministically, so the same input always gives
byte-identical output.

Speed and memory: a tensor that the plan leaves as it is (most readers, the untied head) is
copied from the source shard to the output shard inside the kernel (``os.copy_file_range``),
never entering Python. A tensor whose steps act on whole rows (a writer centred along its hidden
axis, an embedding table, a head with a folded gain) goes from source file to output file a block
of rows at a time, so even a vocab × d table is never whole in memory. Slice-wise steps run on
one reused float64 slice of 1 Mi elements, in place: the same float64 arithmetic as
``fold.chunked`` over the ``fold`` functions, bit for bit, without allocating (and
page-faulting) a fresh float64 buffer per slice. Everything else (column-wise folds, bias folds)
is computed one tensor at a time.

Reads go through ``RecentReads``: a bias fold (b + Wβ) reads its layer's weight, which is the
next tensor written, so the last large tensor read is kept for one more use instead of being read
from disk twice. Running out of disk space becomes a one-line ``NormswapError``; the pipeline
then removes the temporary output.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from normswap.convert import fold
from normswap.convert.plan import (
    Bake,
    Centre,
    ConversionPlan,
    DivideByGain,
    Fill,
    FoldBias,
    FoldGain,
    Rotate,
    TensorPlan,
)
from normswap.convert.source import SAFETENSORS_DTYPE_NAMES, CheckpointReader
from normswap.errors import NormswapError

Read = Callable[[str], torch.Tensor]

# float64 working slice, reused for every slice of a tensor: 8 MiB stays in cache
SLICE_ELEMENTS = 1 << 20

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
        target = torch.float64 if other_steps else plan.dtype
        value = apply_slice_steps(value, slice_steps, read, target, name=plan.name)
    for step in other_steps:
        value = _apply_whole(step, value.double(), read)
    return value.to(plan.dtype)


def apply_slice_steps(value: torch.Tensor, steps: list, read: Read, out_dtype: torch.dtype, *,
                      name: str = "", slice_elements: int = SLICE_ELEMENTS) -> torch.Tensor:
    """Slice-wise ``steps`` applied in float64 to ``value`` slice by slice, cast to ``out_dtype``.

    Every step acts on whole slices across one axis (the hidden axis a writer is centred along,
    or the input axis a reader's gain scales), so ``value`` is cut along another axis into
    slices of about ``slice_elements``. Each slice is copied into one reused float64 buffer,
    transformed in place, and cast into the output.
    """
    axes = {step.axis for step in steps}
    if len(axes) != 1:
        raise AssertionError(f"{name}: slice-wise steps on different axes {axes}")
    axis = axes.pop()
    kernels = [_in_place(step, read) for step in steps]
    out = torch.empty(value.shape, dtype=out_dtype)
    if value.dim() <= 1 or value.numel() == 0:
        out.copy_(_run(kernels, value.to(torch.float64, copy=True)))
        return out
    split = 0 if axis != 0 else 1
    count = value.shape[split]
    step = max(1, slice_elements // (value.numel() // count))
    buffer = torch.empty(min(step, count) * (value.numel() // count), dtype=torch.float64)
    for start in range(0, count, step):
        piece = value.narrow(split, start, min(step, count - start))
        work = buffer[: piece.numel()].view(piece.shape)
        work.copy_(piece)
        out.narrow(split, start, piece.shape[split]).copy_(_run(kernels, work))
    return out


def _run(kernels: list[Callable[[torch.Tensor], torch.Tensor]], work: torch.Tensor) -> torch.Tensor:
    for kernel in kernels:
        work = kernel(work)
    return work


def _in_place(step, read: Read) -> Callable[[torch.Tensor], torch.Tensor]:
    """A float64 slice kernel for ``step``, in place where the math allows.

    Centre: w ← w - mean(w along the hidden axis)    (``fold.centre``)
    FoldGain: w ← w · γ along the input axis           (``fold.fold_gain``)
    Bake: w ← LayerNorm(w) row by row                   (``fold.layer_norm_rows``)
    Rotate: w ← w contracted with Q along the stream axis (``fold.rotate_axis``)
    """
    if isinstance(step, Centre):
        return lambda w: w.sub_(w.mean(dim=step.axis, keepdim=True))
    if isinstance(step, FoldGain):
        gain = read(step.gain).double()

        def scale(w: torch.Tensor) -> torch.Tensor:
            shape = [1] * w.dim()
            shape[step.axis] = -1
            return w.mul_(gain.reshape(shape))

        return scale
    if isinstance(step, Bake):
        gain, bias = read(step.gain), read(step.bias)
        return lambda w: fold.layer_norm_rows(w, gain, bias, step.eps)
    if isinstance(step, Rotate):
        return lambda w: fold.rotate_axis(w, step.rotation.matrix, step.axis)
    raise TypeError(step)


def _apply_whole(step, value: torch.Tensor, read: Read) -> torch.Tensor:
    if isinstance(step, Fill):
        return torch.full_like(value, step.value)
    if isinstance(step, DivideByGain):
        return fold.residual_norm_bias(read(step.gain), value)
    if isinstance(step, FoldBias):
        return fold.chunked_bias_fold(read(step.weight), read(step.norm_bias), value, step.axis)
    if isinstance(step, Rotate):
        return fold.rotate_axis(value, step.rotation.matrix, step.axis)
    raise TypeError(step)


# ---------------------------------------------------------------------------------------------


def _header(plans: list[TensorPlan]) -> tuple[bytes, list[int]]:
    """A safetensors header for ``plans`` in order, and each tensor's data offset."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, position = [], 0
    for plan in plans:
        size = plan.nbytes
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



class RecentReads:
    """``read`` that remembers the last large tensor and a bounded set of small ones.

    Large means above ``small_bytes``; only one is kept, so the extra memory is at most one
    tensor of the group being written. Small tensors (norm gains and biases, read by every
    reader of a norm) are kept up to ``small_items``. Callers never modify what they get.
    """

    def __init__(self, read: Read, small_bytes: int = 1 << 20, small_items: int = 256) -> None:
        self._read = read
        self._small_bytes = small_bytes
        self._small_items = small_items
        self._small: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._large: tuple[str, torch.Tensor] | None = None
        self.disk_reads = 0

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._small:
            return self._small[name]
        if self._large is not None and self._large[0] == name:
            return self._large[1]
        self._large = None  # drop the previous large tensor before reading the next one
        value = self._read(name)
        self.disk_reads += 1
        if value.numel() * value.element_size() <= self._small_bytes:
            self._small[name] = value
            if len(self._small) > self._small_items:
                self._small.popitem(last=False)
        else:
            self._large = (name, value)
        return value


class ShardSource:
    """What the writer needs from the checkpoint: cached reads, and the fast paths it allows.

    * ``unchanged(plan)``: (fd, offset) of the source bytes of a tensor the plan keeps as it is
      (same dtype, no steps): copied file to file in the kernel.
    * ``row_streamable(plan)``: the plan has only slice-wise steps across a non-leading axis
      (centring a writer along its hidden axis, folding a gain into rows), so the tensor can go
      from source file to output file a block of rows at a time, never whole in memory.
    Both need a safetensors source; anything else is computed whole with ``compute_tensor``.
    """

    def __init__(self, reader: CheckpointReader | None = None, read: Read | None = None) -> None:
        self.reader = reader
        self.read = read if read is not None else RecentReads(reader.get)
        self._direct = reader is not None and getattr(reader, "is_safetensors", False)
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, role: str, nbytes: int) -> torch.Tensor:
        """A uint8 scratch buffer of at least ``nbytes``, kept for the next tensor: allocating
        fresh multi-MB buffers per tensor fragments the heap and ratchets RSS up."""
        held = self._buffers.get(role)
        if held is None or held.numel() < nbytes:
            held = self._buffers[role] = torch.empty(nbytes, dtype=torch.uint8)
        return held[:nbytes]

    def unchanged(self, plan: TensorPlan) -> tuple[int, int] | None:
        if not self._direct or plan.steps or plan.source is None or not hasattr(os, "copy_file_range"):
            return None
        if self.reader.tensors[plan.source].dtype != plan.dtype:
            return None
        return self.reader.locate(plan.source)

    def row_streamable(self, plan: TensorPlan) -> bool:
        return (
            self._direct and plan.source is not None and len(plan.shape) >= 2 and plan.shape[0] > 0
            and bool(plan.steps) and all(step.slice_wise and step.axis != 0 for step in plan.steps)
        )


def write_shard(path: Path, plans: list[TensorPlan], source: ShardSource | Read, progress=None) -> int:
    """Stream ``plans`` into one safetensors file at ``path``; returns the bytes of tensor data.

    The file's full size is reserved first (``posix_fallocate``) so that a full disk is found
    before any work is done rather than halfway through.
    """
    if not isinstance(source, ShardSource):
        source = ShardSource(read=source)
    header, offsets = _header(plans)
    total = sum(plan.nbytes for plan in plans)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
        try:
            _reserve(fd, len(header) + total)
            _write_at(fd, 0, memoryview(header))
            for plan, offset in zip(plans, offsets, strict=True):
                _write_tensor(fd, len(header) + offset, plan, source)
                if progress is not None:
                    progress(plan.nbytes)
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NormswapError(f"no space left on the device while writing {path.name}; nothing was written") from None
        raise
    return total


def _write_tensor(fd: int, position: int, plan: TensorPlan, source: ShardSource) -> None:
    """Write one tensor's bytes at ``position``: copied when unchanged, streamed by rows when the
    steps allow, else computed whole."""
    where = source.unchanged(plan)
    if where is not None and _copy_at(where[0], where[1], fd, position, plan.nbytes):
        return
    if source.row_streamable(plan):
        _stream_rows(fd, position, plan, source)
        return
    value = compute_tensor(plan, source.read)
    if tuple(value.shape) != tuple(plan.shape):
        raise AssertionError(f"{plan.name}: computed shape {tuple(value.shape)} != {plan.shape}")
    _write_at(fd, position, _bytes_of(value))


def _stream_rows(fd: int, position: int, plan: TensorPlan, source: ShardSource,
                 slice_elements: int = SLICE_ELEMENTS) -> None:
    """Read, transform (float64, in place) and write ``plan`` a block of rows at a time.

    Row blocks are whole slices for steps along a non-leading axis, so the values are exactly
    those of ``apply_slice_steps``; memory holds three buffers of one block each.
    """
    rows_total = plan.shape[0]
    row = max(1, math.prod(plan.shape[1:]))
    rows = max(1, slice_elements // row)
    kernels = [_in_place(step, source.read) for step in plan.steps]
    source_dtype = source.reader.tensors[plan.source].dtype
    raw = source.buffer("raw", rows * row * source_dtype.itemsize)
    work = source.buffer("work", rows * row * 8).view(torch.float64)
    out = source.buffer("out", rows * row * plan.dtype.itemsize).view(plan.dtype)
    out_row_bytes = row * plan.dtype.itemsize
    for start in range(0, rows_total, rows):
        count = min(rows, rows_total - start)
        piece = source.reader.read_rows(plan.source, start, count, raw)
        block = work[: count * row].view(piece.shape)
        block.copy_(piece)
        result = out[: count * row].view(piece.shape)
        result.copy_(_run(kernels, block))
        _write_at(fd, position + start * out_row_bytes, _bytes_of(result))


def _bytes_of(value: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
    return memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy())


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes for the file now; raises ENOSPC when the disk cannot hold them."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # the filesystem cannot reserve space; writes will report ENOSPC instead
        raise


def _write_at(fd: int, offset: int, data: memoryview) -> None:
    """Write all of ``data`` at ``offset`` (a single write may be partial)."""
    data = data.cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _copy_at(source_fd: int, source_offset: int, fd: int, offset: int, count: int) -> bool:
    """Copy ``count`` bytes between files in the kernel; False when this filesystem pair cannot."""
    done = 0
    try:
        while done < count:
            copied = os.copy_file_range(source_fd, fd, count - done, source_offset + done, offset + done)
            if copied == 0:
                raise NormswapError("a source weight file ended early (it shrank while it was read)")
            done += copied
    except OSError as error:
        if done == 0 and error.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return False
        raise
    return True


def write_weights(out_dir: Path, plan: ConversionPlan, reader: CheckpointReader, progress=None) -> None:
    """Every output shard, plus ``model.safetensors.index.json`` when there are several.

    The index follows transformers: ``metadata.total_size`` is the bytes of tensor data and
    ``weight_map`` names each tensor's shard, keys sorted.
    """
    by_shard: dict[str, list[TensorPlan]] = {shard: [] for shard in plan.shards}
    for tensor in plan.tensors.values():
        by_shard[tensor.shard].append(tensor)
    source = ShardSource(reader)
    total = 0
    with _one_thread():
        for shard, tensors in by_shard.items():
            total += write_shard(out_dir / shard, tensors, source, progress)
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: tensor.shard for name, tensor in plan.tensors.items()},
        }
        write_json(out_dir / "model.safetensors.index.json", index)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops on one thread: slice math is memory-bound, and on a busy machine every
    multi-threaded op waits for its slowest thread (measured: 6x slower on 2 shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
