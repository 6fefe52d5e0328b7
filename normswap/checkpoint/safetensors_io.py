"""The safetensors format, in one place: header parsing and validation, positioned reads, and
the pieces of the streaming shard writer.

A file is ``[8-byte little-endian header length n][n bytes of JSON][data]``; each header entry
gives a tensor's dtype, shape and ``data_offsets`` [begin, end) into the data section.

The ``safetensors`` package is used where it fits (the small rotation file). Conversion does not
use it: ``safe_open`` memory-maps the file, and mapped pages stay resident (and count in the
process's RSS) as long as the file is open, so reading a 100 GB checkpoint through it looks like a
100 GB process; and ``save_file`` needs every tensor of a shard in memory at once, where the
writer streams one tensor (or one block of rows) at a time at offsets known from the header.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from normswap.checkpoint.bounded import json_kind, parse_json
from normswap.dtypes import check_tensor_dtype, dtype_name, itemsize, torch_dtype
from normswap.errors import NormswapError

if TYPE_CHECKING:  # torch is imported where tensors are read: resolving a source stays light
    import numpy
    import torch

# torch's dtype names -> numpy's, for the dtypes numpy has
_NUMPY_DTYPES = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
                 "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype | str) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (a ``torch.dtype`` or its name), as stored."""
    return math.prod(shape) * itemsize(dtype)


class StoredTensor:
    """What a tensor's ``shape`` and ``dtype_name`` say about it (a mixin for the dataclasses
    that describe a tensor before it is read or written)."""

    shape: tuple[int, ...]
    dtype_name: str

    @property
    def dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by ``dtype_name``."""
        return torch_dtype(self.dtype_name)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor as stored."""
        return tensor_nbytes(self.shape, self.dtype_name)


class SafetensorsShard:
    """One safetensors file: its header parsed and checked at open, tensors read on demand.

    The file is ``[8-byte little-endian header length n][n bytes of JSON][data]``; each header
    entry gives a tensor's dtype, shape and ``data_offsets`` [begin, end) into the data section.
    ``entries`` holds, per tensor, torch's name of its dtype (``float32``; parsing imports no
    torch), its shape and its byte range. A header that does not parse, or promises bytes the file
    does not have (a truncated download), is reported at once as a ``NormswapError``.

    The header is read once; the file may be closed (``close``) and opened again (``reopen``) while
    it is read, as ``source.CheckpointReader`` keeps a bounded pool of shards open, and it must be
    the very file first opened each time.
    """

    MAX_HEADER_BYTES = 100 * 1024 * 1024

    def __init__(self, file: Path) -> None:
        self.file = file
        self._fd = os.open(file, os.O_RDONLY)
        try:
            self._identity = _identity(os.fstat(self._fd))
            self.entries = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def is_open(self) -> bool:
        return self._fd >= 0

    def reopen(self) -> None:
        """Open the file again after ``close``. It must be the file first opened: the same device,
        inode, size and modification time; a file replaced, rewritten or removed meanwhile is
        refused, since its header (read at first open) no longer describes it."""
        if self._fd >= 0:
            return
        try:
            fd = os.open(self.file, os.O_RDONLY)
        except FileNotFoundError:
            raise NormswapError(f"{self.file} changed while it was read (it was removed)") from None
        if _identity(os.fstat(fd)) != self._identity:
            os.close(fd)
            raise NormswapError(f"{self.file} changed while it was read")
        self._fd = fd

    def _corrupt(self, why: str) -> NormswapError:
        return NormswapError(f"weight file {self.file} is corrupt or truncated: {why}")

    def _parse_header(self) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        size = self._identity[2]
        if size < 8:
            raise self._corrupt(f"{size} bytes, too short for a safetensors header")
        length = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if length > min(size - 8, self.MAX_HEADER_BYTES):
            raise self._corrupt(f"header length {length} does not fit in the file's {size} bytes")
        try:
            header = parse_json(os.pread(self._fd, length, 8), "header", mapping=False, unique_keys=True)
        except NormswapError as error:
            raise self._corrupt(f"unreadable header ({str(error).removeprefix('cannot read header: ')})") from None
        if not isinstance(header, dict):
            raise self._corrupt("the header is not a JSON object")
        self.data_start = 8 + length
        data_bytes = size - self.data_start
        entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                self._check_metadata(entry)
                continue
            entries[name] = self._check_entry(name, entry, data_bytes)
        self._check_layout(entries, data_bytes)
        return entries

    def _check_metadata(self, metadata: object) -> None:
        """``__metadata__`` is a map of strings to strings in the format, or null for none: the
        safetensors library refuses anything else when a loader opens the file."""
        if metadata is None:
            return
        if not isinstance(metadata, dict):
            raise self._corrupt(f"__metadata__ is {json_kind(metadata)}; it must map strings to strings")
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise self._corrupt(f"__metadata__ maps {key!r:.40} to {json_kind(value)}; it must map "
                                    "strings to strings")

    def _check_entry(self, name: str, entry: object, data_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._corrupt(f"header entry {name} is not a mapping with dtype, shape and data_offsets")
        code = entry["dtype"]
        if not isinstance(code, str) or not code.replace("_", "").isalnum() or len(code) > 16:
            raise self._corrupt(f"{name} has dtype {code!r:.40}, which is not a safetensors dtype")
        dtype = _safetensors_dtypes().get(code)
        check_tensor_dtype(name, dtype or code, f"weight file {self.file}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_natural(size) for size in shape):
            raise self._corrupt(f"{name} has shape {shape!r:.60}; dimensions must be non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(offset) for offset in offsets):
            raise self._corrupt(f"{name} has data_offsets {offsets!r:.60}; they must be two non-negative integers")
        shape, (begin, end) = tuple(shape), offsets
        if end - begin != tensor_nbytes(shape, dtype):
            raise self._corrupt(f"{name}: data_offsets {begin}..{end} do not match shape {list(shape)} of {entry['dtype']}")
        if end > data_bytes:
            raise self._corrupt(f"{name} ends at byte {end} of a data section of {data_bytes} bytes")
        return dtype, shape, begin, end

    def _check_layout(self, entries: dict, data_bytes: int) -> None:
        """Tensors must tile the data section exactly: no overlap, no gap, no trailing bytes."""
        position, previous = 0, None
        for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
            if begin < position:
                raise self._corrupt(f"{name} overlaps {previous} (bytes {begin}..{end})")
            if begin > position:
                raise self._corrupt(f"bytes {position}..{begin} before {name} belong to no tensor")
            position, previous = end, name
        if position != data_bytes:
            raise self._corrupt(f"{data_bytes - position} trailing bytes after the last tensor")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, copied from the file into fresh memory."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        self._pread(name, buffer, begin)
        return buffer.view(torch_dtype(dtype)).reshape(shape)

    def read_rows(self, name: str, start: int, count: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start``..``start+count`` (along the first axis) of ``name``, read into ``buffer``
        (a uint8 tensor, reused by the caller) when given."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        row = (end - begin) // shape[0]
        raw = torch.empty(row * count, dtype=torch.uint8) if buffer is None else buffer[: row * count]
        self._pread(name, raw, begin + start * row)
        return raw.view(torch_dtype(dtype)).reshape(count, *shape[1:])

    def mapped_rows(self, name: str, start: int, count: int) -> torch.Tensor:
        """Rows ``start``..``start+count`` of ``name`` as a tensor over the file's own pages, mapped
        (copy-on-write) for as long as the tensor or a view of it lives: nothing is copied, so a
        comparison reads the disk cache directly instead of a copy that ``read_rows`` first makes.

        A file that shrinks while its mapped pages are read raises SIGBUS, which ends the
        process: only a process that runs nothing else (the weights proof's own) reads this way."""

        import torch

        dtype, shape, begin, end = self.entries[name]
        row = (end - begin) // shape[0]
        first, length = self.data_start + begin + start * row, row * count
        if os.fstat(self._fd).st_size < first + length:
            raise self._corrupt(f"{name} ends early (the file shrank while it was read)")
        if length == 0:
            return torch.empty((count, *shape[1:]), dtype=torch_dtype(dtype))
        base = first - first % mmap.ALLOCATIONGRANULARITY
        pages = mmap.mmap(self._fd, first + length - base, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
        raw = torch.frombuffer(pages, dtype=torch.uint8, offset=first - base, count=length)  # holds ``pages``
        return raw.view(torch_dtype(dtype)).reshape(count, *shape[1:])

    def read_array(self, name: str) -> numpy.ndarray:
        """The tensor ``name`` as a numpy array, without torch (bfloat16 widened exactly to
        float32; the float8 types, which numpy lacks, are read through torch)."""
        import numpy

        dtype, shape, begin, end = self.entries[name]
        if dtype not in _NUMPY_DTYPES and dtype != "bfloat16":
            return self.read(name).float().numpy()
        raw = numpy.empty(end - begin, dtype=numpy.uint8)
        self._pread(name, raw, begin)
        if dtype == "bfloat16":  # the upper half of a float32
            return (raw.view("<u2").astype(numpy.uint32) << 16).view(numpy.float32).reshape(shape)
        return raw.view(_NUMPY_DTYPES[dtype]).reshape(shape)

    def _pread(self, name: str, into: torch.Tensor | numpy.ndarray, offset: int) -> None:
        view = memoryview(into if not hasattr(into, "dim") else into.numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], self.data_start + offset + done)
            if got <= 0:
                raise self._corrupt(f"{name} ends early (the file shrank while it was read)")
            done += got

    def locate(self, name: str) -> tuple[int, int]:
        """The open file descriptor and absolute offset of the bytes of ``name`` (the descriptor
        lasts until ``close``)."""
        _, _, begin, _ = self.entries[name]
        return self._fd, self.data_start + begin

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def encode_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    """The safetensors header (length prefix included) for ``(name, dtype, shape)`` in that order,
    and each tensor's offset in the data section.

    Serialised deterministically (no metadata but the format, compact separators) so that the
    same tensors always give the same bytes.
    """
    names = {dtype: key for key, dtype in _safetensors_dtypes().items()}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, position = [], 0
    for name, dtype, shape in tensors:
        size = tensor_nbytes(shape, dtype)
        header[name] = {"dtype": names[dtype_name(dtype)], "shape": list(shape), "data_offsets": [position, position + size]}
        offsets.append(position)
        position += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded, offsets


def create_sized(path: Path, size: int) -> int:
    """A read-write descriptor of ``path``, created (or truncated) at its final ``size``; the
    caller closes it. (A proof taken while writing reads each block back through it.)

    The file is sized first, sparse (``ftruncate``), and then filled at known offsets: space
    reserved with ``posix_fallocate`` instead is held as unwritten extents, and on ext4 turning
    each written page's extent from unwritten to written makes the writes many times slower than
    filling a sparse file. A full disk is refused before any work by the free-space check of the
    whole output (``space.check_free_space``); running out of space while writing (another
    process filling the disk) still becomes a one-line ``NormswapError`` (``space_errors``).
    """
    with space_errors(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd


@contextmanager
def space_errors(path: Path) -> Iterator[None]:
    """A full disk (or quota) while writing ``path`` becomes one ``NormswapError`` line."""
    try:
        yield
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NormswapError(f"no space left on the device while writing {path.name}; nothing was written") from None
        raise


def bytes_of(value: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
    import torch

    return memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_at(fd: int, offset: int, data: memoryview) -> None:
    """Write all of ``data`` at ``offset`` (a single write may be partial)."""
    data = data.cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def read_at(fd: int, offset: int, into: torch.Tensor) -> torch.Tensor:
    """Fill the uint8 tensor ``into`` with the bytes at ``offset`` (a single read may be partial);
    a file that ends first is a ``NormswapError``."""
    view = memoryview(into.numpy()).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise NormswapError("a weight file ended early (it shrank while it was read)")
        done += got
    return into


def copy_range(source_fd: int, source_offset: int, fd: int, offset: int, count: int) -> bool:
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


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file from its replacement or a rewrite: device, inode, size, modification time."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


@cache
def _safetensors_dtypes() -> dict[str, str]:
    """The format's dtype codes -> torch's names for them."""
    return {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "BOOL": "bool",
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "C64": "complex64",
        "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
    }
