"""Write: a plan's tensors into safetensors shards, streamed, plus the files copied beside them.

Each shard's header is written first (every shape is known from the plan), then each tensor is
computed and written at its offset. Memory holds one tensor group (a tensor and the few it
depends on: a reader weight for a bias fold, a norm gain), never a whole shard, and peak memory
does not grow with the number of layers. Tensors are laid out in name order and the header is
serialised deterministically, so the same input always gives byte-identical output.

Per tensor, the cheapest of three ways is taken. A tensor the plan leaves as it is (most readers,
the untied head) is copied from source shard to output shard inside the kernel
(``os.copy_file_range``), never entering Python. A tensor whose steps act on blocks of whole rows (a
writer centred along either axis, an embedding table, a head with a folded gain) goes from source
file to output file a block of rows at a time through ``fold``'s in-place row kernels, so even a
vocab × d table is never whole in memory; a writer centred along its leading axis takes one more
pass over its rows first, for the column means. Everything else is computed whole by
``fold.compute_tensor``. Reads go through ``source.RecentReads`` (a bias fold reads its layer's
weight, the next tensor written, once). The file format itself is ``safetensors_io``'s.

A ``Witness`` (the weights proof of the command that writes) sees every block as it is written:
the float64 value the writer computed, or the source bytes of a kept tensor, beside where its
bytes now are. A kept tensor then goes through a buffer instead of the kernel, so that the
proof checks the bytes the writer read; the source is read once, for both.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Protocol

import torch

from normswap.checkpoint import safetensors_io
from normswap.checkpoint.files import SIDE_FILES, copy_inside_file
from normswap.checkpoint.source import CheckpointReader, RecentReads
from normswap.convert import fold
from normswap.convert.plan import ConversionPlan, TensorPlan
from normswap.threads import WorkQueue, tensor_workers

Progress = Callable[[int], None]
# a kept tensor's rows per block when a witness sees them: two buffers of this size per writer thread
COPY_CHUNK_BYTES = 4 << 20


class Witness(Protocol):
    """What checks each tensor as it is written, over the writer's own reads
    (``normswap.verify.proof.WrittenProof``). Each call may come from any writer thread; a call
    that finds a wrong block raises, and the write fails with its error."""

    def identical(self, plan: TensorPlan, expected: torch.Tensor, fd: int, position: int) -> None:
        """``expected`` (uint8), bytes of ``plan.source`` the writer read, now stored at ``position``
        of ``fd``: a tensor the plan keeps as it is."""

    def computed(self, plan: TensorPlan, start: int, value: torch.Tensor, fd: int, position: int) -> None:
        """``value``: float64 rows from row ``start`` of what the plan makes ``plan``, before the
        cast the writer stored at ``position`` of ``fd``."""

    @property
    def last(self) -> Collection[str]:
        """The tensors the check after the write reads again (its forward passes), written last:
        they and their sources are then the newest pages of the page cache when it runs."""

    def figures(self, output_dir: Path, identical: dict[str, str] | None = None) -> dict:
        """Once the write is done, the proof's figures for the checkpoint at ``output_dir``
        (``identical`` receives each tensor kept byte for byte: name -> source name)."""


class ScratchBuffers:
    """uint8 scratch buffers by role, each kept for the next tensor: allocating fresh multi-MB
    buffers per tensor fragments the heap and ratchets RSS up. One set per thread."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def __call__(self, role: str, nbytes: int) -> torch.Tensor:
        """The ``role`` buffer's first ``nbytes`` bytes, grown when it is shorter."""
        held = self._held.get(role)
        if held is None or held.numel() < nbytes:
            held = self._held[role] = torch.empty(nbytes, dtype=torch.uint8)
        return held[:nbytes]


class ShardSource:
    """What the writer needs from the checkpoint: cached reads, and the fast paths it allows.

    * ``keeps_bytes(plan)``: the plan keeps the tensor as it is (same dtype, no steps);
      ``unchanged(plan)``: (fd, offset) of its source bytes, copied file to file in the kernel,
      within ``holding(plan)``.
    * ``row_streamable(plan)``: every step of the plan runs on blocks of whole rows
      (``fold.runs_on_rows``: centring a writer along either axis, folding a gain, baking a norm
      into a table), so the tensor can go from source file to output file a block of rows at a
      time, never whole in memory.
    Both need a safetensors source; anything else is computed whole with ``compute_tensor``.
    """

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.read = RecentReads(reader.get)
        self._direct = reader.is_safetensors
        self.buffer = ScratchBuffers()

    def keeps_bytes(self, plan: TensorPlan) -> bool:
        """The plan keeps this tensor as it is: no steps, the source's dtype, so its bytes are the source's."""
        return not plan.steps and plan.source is not None and self.reader.tensors[plan.source].dtype == plan.dtype

    def unchanged(self, plan: TensorPlan) -> tuple[int, int] | None:
        if not self._direct or not self.keeps_bytes(plan) or not hasattr(os, "copy_file_range"):
            return None
        return self.reader.locate(plan.source)

    def holding(self, plan: TensorPlan) -> contextlib.AbstractContextManager:
        """The source shard of ``plan``'s tensor held open while the block runs (``unchanged``'s
        descriptor is valid only meanwhile)."""
        if not self._direct or plan.source is None:
            return contextlib.nullcontext()
        return self.reader.holding(plan.source)

    def row_streamable(self, plan: TensorPlan) -> bool:
        return (
            self._direct and plan.source is not None and len(plan.shape) >= 2 and plan.shape[0] > 0
            and bool(plan.steps) and all(fold.runs_on_rows(step) for step in plan.steps)
        )


class OutputShards:
    """The output shard files of ``by_shard`` (shard name -> its tensors, in their order), each
    created sized (sparse) with its header written when its first tensor is placed, and closed
    once its last one is written: tensors can be written in any order, by any thread."""

    def __init__(self, out_dir: Path, by_shard: dict[str, list[TensorPlan]]) -> None:
        self.out_dir = out_dir
        self._layout: dict[str, tuple[bytes, int]] = {}
        self._position: dict[str, tuple[str, int]] = {}
        for shard, plans in by_shard.items():
            header, offsets = safetensors_io.encode_header([(plan.name, plan.dtype, plan.shape) for plan in plans])
            self._layout[shard] = header, len(header) + sum(plan.nbytes for plan in plans)
            for plan, offset in zip(plans, offsets, strict=True):
                self._position[plan.name] = shard, len(header) + offset
        self._left = {shard: len(plans) for shard, plans in by_shard.items()}
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def place(self, plan: TensorPlan) -> tuple[int, int]:
        """(descriptor, offset) to write ``plan``'s bytes at."""
        shard, position = self._position[plan.name]
        with self._lock:
            if shard not in self._open:
                self._open[shard] = self._created(shard)
            return self._open[shard], position

    def written(self, plan: TensorPlan) -> None:
        shard, _ = self._position[plan.name]
        with self._lock:
            self._left[shard] -= 1
            if not self._left[shard]:
                os.close(self._open.pop(shard))

    def create_empty(self) -> None:
        """The file of every shard that holds no tensor (its header alone)."""
        for shard, left in self._left.items():
            if not left:
                os.close(self._created(shard))

    def _created(self, shard: str) -> int:
        """A descriptor of ``shard``'s new file: created at its full size, its header written."""
        header, size = self._layout[shard]
        fd = safetensors_io.create_sized(self.out_dir / shard, size)
        try:
            with safetensors_io.space_errors(self.out_dir / shard):
                safetensors_io.write_at(fd, 0, memoryview(header))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        """Close what is still open: after a failure, whose error is the one to report."""
        with self._lock:
            for fd in self._open.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._open.clear()


def write_tensor(fd: int, position: int, plan: TensorPlan, source: ShardSource,
                 whole: threading.Lock | None = None, witness: Witness | None = None) -> None:
    """Write one tensor's bytes at ``position``: copied when unchanged, streamed by rows when the
    steps allow, else computed whole (holding ``whole``, when given, meanwhile); ``witness``, when
    given, sees every block written."""
    if witness is not None and source.keeps_bytes(plan):
        _copy_witnessed(fd, position, plan, source, witness)
        return
    with source.holding(plan):  # the source shard's descriptor stays open while the kernel copies from it
        where = source.unchanged(plan)
        if where is not None and safetensors_io.copy_range(where[0], where[1], fd, position, plan.nbytes):
            return
    if source.row_streamable(plan):
        _stream_rows(fd, position, plan, source, witness)
        return
    with whole if whole is not None else contextlib.nullcontext():
        exact = fold.compute_tensor(plan, source.read, torch.float64) if witness is not None else None
        value = fold.compute_tensor(plan, source.read) if exact is None else exact.to(plan.dtype)
        if tuple(value.shape) != tuple(plan.shape):
            raise AssertionError(f"{plan.name}: computed shape {tuple(value.shape)} != {plan.shape}")
        safetensors_io.write_at(fd, position, safetensors_io.bytes_of(value))
        if exact is not None:
            row_bytes = _row_bytes(plan)
            for start, rows in _row_slices(exact, fold.SLICE_ELEMENTS):
                witness.computed(plan, start, rows, fd, position + start * row_bytes)
        del value, exact  # before another thread computes the next whole tensor


def _row_bytes(plan: TensorPlan) -> int:
    return max(1, math.prod(plan.shape[1:])) * plan.dtype.itemsize


def _copy_witnessed(fd: int, position: int, plan: TensorPlan, source: ShardSource, witness: Witness) -> None:
    """A kept tensor copied through a buffer, a block of rows at a time, each block shown to
    ``witness`` with the bytes it was read as: the source is read once for the copy and its proof."""
    reader = source.reader
    if not reader.is_safetensors or not plan.shape or plan.nbytes == 0:
        value = reader.get(plan.source)
        data = value.contiguous().reshape(-1).view(torch.uint8)
        safetensors_io.write_at(fd, position, safetensors_io.bytes_of(data))
        witness.identical(plan, data, fd, position)
        return
    row_bytes = _row_bytes(plan)
    rows = max(1, COPY_CHUNK_BYTES // row_bytes)
    buffer = source.buffer("copy", min(rows, plan.shape[0]) * row_bytes)
    for start in range(0, plan.shape[0], rows):
        count = min(rows, plan.shape[0] - start)
        data = reader.read_rows(plan.source, start, count, buffer).reshape(-1).view(torch.uint8)
        safetensors_io.write_at(fd, position + start * row_bytes, safetensors_io.bytes_of(data))
        witness.identical(plan, data, fd, position + start * row_bytes)


def _stream_rows(fd: int, position: int, plan: TensorPlan, source: ShardSource,
                 witness: Witness | None = None) -> None:
    """Read, transform (float64, in place) and write ``plan`` a block of rows at a time
    (``row_blocks``); memory holds three buffers of one block each."""
    out_row_bytes = _row_bytes(plan)
    for start, block in row_blocks(plan, source):
        result = source.buffer("out", block.numel() * plan.dtype.itemsize).view(plan.dtype).view(block.shape)
        result.copy_(block)
        safetensors_io.write_at(fd, position + start * out_row_bytes, safetensors_io.bytes_of(result))
        if witness is not None:
            witness.computed(plan, start, block, fd, position + start * out_row_bytes)


def row_blocks(plan: TensorPlan, source: ShardSource,
               slice_elements: int = fold.SLICE_ELEMENTS) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float64 rows) of a ``row_streamable`` tensor's value, block by block: each block
    read from the source and run through ``fold``'s in-place row kernels. Each block is overwritten
    by the next.

    A centring along the leading axis (``fold.centres_columns``: an nn.Linear writer [d, in]) needs
    each column's mean over all d rows: a first pass over the blocks sums the columns in float64,
    the steps before it applied, and the blocks then subtract mean = sum / d. For a float16 source
    with d < 8192 every partial sum is exact (each value a multiple of 2⁻²⁴ below 2¹⁶), so the mean
    is the one ``fold.centre_`` takes over the whole column, whatever the block size."""
    if math.prod(plan.shape) == 0:  # no elements, no rows to walk, whatever the first dimension says
        yield 0, torch.empty(tuple(plan.shape), dtype=torch.float64)
        return
    rows_total = plan.shape[0]
    row = math.prod(plan.shape[1:])
    rows = max(1, slice_elements // row)
    source_dtype = source.reader.tensors[plan.source].dtype
    raw = source.buffer("raw", rows * row * source_dtype.itemsize)
    work = source.buffer("work", rows * row * 8).view(torch.float64)
    kernels: list[fold.RowKernel] = []

    def blocks() -> Iterator[tuple[int, torch.Tensor]]:
        for start in range(0, rows_total, rows):
            count = min(rows, rows_total - start)
            piece = source.reader.read_rows(plan.source, start, count, raw)
            block = work[: count * row].view(piece.shape)
            block.copy_(piece)
            for kernel in kernels:
                block = kernel(block, start)
            yield start, block

    for step in plan.steps:
        if fold.centres_columns(step):
            total = torch.zeros(tuple(plan.shape[1:]), dtype=torch.float64)
            for _, block in blocks():
                total += block.sum(dim=0)
            mean = total.div_(rows_total)
            kernels.append(lambda w, start, mean=mean: w.sub_(mean))
        else:
            kernels.append(fold.row_kernel(step, source.read))
    yield from blocks()


def expected_blocks(plan: TensorPlan, source: ShardSource,
                    slice_elements: int = fold.SLICE_ELEMENTS) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, float64 rows) of the value ``plan`` says the output tensor has, before its
    cast to the output dtype: what ``write_tensor`` writes, by the same code path (``row_blocks``
    for row-streamable tensors, ``fold.compute_tensor`` in float64 for the rest, cut into row
    blocks of about ``slice_elements``)."""
    if source.row_streamable(plan):
        yield from row_blocks(plan, source, slice_elements)
        return
    yield from _row_slices(fold.compute_tensor(plan, source.read, torch.float64), slice_elements)


def _row_slices(value: torch.Tensor, slice_elements: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of ``value`` in slices of about ``slice_elements`` (a scalar or an empty
    tensor whole)."""
    if value.dim() == 0 or value.shape[0] == 0:
        yield 0, value
        return
    rows = max(1, slice_elements // max(1, value.numel() // value.shape[0]))
    for start in range(0, value.shape[0], rows):
        yield start, value[start: start + rows]


def write_weights(out_dir: Path, plan: ConversionPlan, reader: CheckpointReader,
                  progress: Progress | None = None, workers: int | None = None,
                  witness: Witness | None = None) -> None:
    """Every output shard, plus ``model.safetensors.index.json`` when there are several.

    ``workers`` threads (default ``threads.tensor_workers``; one for a pickled source) share the
    tensors, each writing the next one in plan order (the ``witness``'s ``last`` tensors at the
    end) at its place: writing into the page cache
    is bound by the memory copies of the core that makes them, so a second core adds its own.
    Only one tensor at a time is computed whole, so that memory holds one. The bytes are the
    same whatever the split, and whether a ``witness`` sees the blocks. The index follows
    transformers: ``metadata.total_size`` is the bytes of tensor data and ``weight_map`` names
    each tensor's shard, keys sorted.
    """
    by_shard = tensors_by_shard(plan)
    last = set(witness.last) if witness is not None else set()
    order = sorted((tensor for tensors in by_shard.values() for tensor in tensors), key=lambda t: t.name in last)
    total = sum(tensor.nbytes for tensor in order)
    if workers is None:
        workers = tensor_workers(total) if reader.is_safetensors else 1
    files, queue = OutputShards(out_dir, by_shard), WorkQueue(len(order))
    whole, reported = threading.Lock(), threading.Lock()

    def work(queue: WorkQueue) -> None:
        source = ShardSource(reader)  # its own buffers and recent reads; the reader is shared
        while (index := queue.take()) is not None:
            tensor = order[index]
            try:
                fd, position = files.place(tensor)
                with safetensors_io.space_errors(out_dir / tensor.shard):
                    write_tensor(fd, position, tensor, source, whole, witness)
                    files.written(tensor)  # closing a finished shard may report a full disk too
                if progress is not None:
                    with reported:
                        progress(tensor.nbytes)
            except Exception as error:  # raised by ``run``, in the calling thread
                queue.fail(index, error)
                return

    try:
        files.create_empty()
        queue.run(work, workers)
    finally:
        files.close()
    if len(plan.shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: tensor.shard for name, tensor in plan.tensors.items()},
        }
        write_json(out_dir / "model.safetensors.index.json", index)


def tensors_by_shard(plan: ConversionPlan) -> dict[str, list[TensorPlan]]:
    """The plan's tensors per output shard, in the order they are written."""
    by_shard: dict[str, list[TensorPlan]] = {shard: [] for shard in plan.shards}
    for tensor in plan.tensors.values():
        by_shard[tensor.shard].append(tensor)
    return by_shard


def copy_side_files(source_dir: Path, out_dir: Path) -> list[str]:
    """Copy tokenizer, processor and generation files; returns their names.

    Each is copied only as a regular file inside the checkpoint (``checkpoint.files``). A JSON file's ``auto_map`` (custom tokenizer or processor code) is dropped: normswap never
    copies a checkpoint's code, so the entry would name a file the output does not have.
    """
    copied = []
    for name in SIDE_FILES:
        if copy_inside_file(source_dir, name, out_dir / name):
            if name.endswith(".json"):
                _drop_auto_map(out_dir / name)
            copied.append(name)
    return copied


def _drop_auto_map(path: Path) -> None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # copied as it is; transformers reports it when it loads the file
    if isinstance(data, dict) and "auto_map" in data:
        del data["auto_map"]
        write_json(path, data)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
