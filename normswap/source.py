"""Load: find a checkpoint and read its tensors lazily.

``resolve_source`` turns what the user typed (a local directory, a Hugging Face hub id, or the
bundled example) into a local directory. ``CheckpointReader`` opens the weight files of that
directory without reading them: tensors are fetched one at a time, so a conversion never holds
more than the group of tensors it is working on.

Safetensors shards are read with positioned reads (``os.preadv``) at the offsets named in their
header, not memory-mapped: pages of a mapping stay resident (and count in the process's RSS) as
long as the file is open, so reading a 100 GB checkpoint through ``safe_open`` would look like a
100 GB process. A read copies exactly one tensor into memory the process owns and frees.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from normswap.errors import NormswapError

if TYPE_CHECKING:  # torch is imported where tensors are read: resolving a source stays light
    import torch

EXAMPLE_MODEL = "normswap:austen-gpt2"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_FILE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def example_model_path() -> Path:
    """Directory of the small GPT-2 trained on Austen that ships inside the package."""
    return Path(str(resources.files("normswap") / "data" / "austen-gpt2"))


def resolve_source(src: str | Path, *, trust_remote_code: bool = False) -> Path:
    """A local directory in Hugging Face layout for ``src``.

    ``src`` is a local directory, the bundled example (``normswap:austen-gpt2``), or a hub id
    that is downloaded when the hub is reachable. Only configuration, tokenizer and weight files
    are fetched; Python files only with ``trust_remote_code``.
    """
    if str(src) == EXAMPLE_MODEL:
        path = example_model_path()
        if not (path / "config.json").is_file():
            raise NormswapError(f"the bundled example model is missing from this install ({path})")
        return path
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NormswapError(f"{src} is not a directory; pass a checkpoint directory or a hub id")
        if not (path / "config.json").is_file():
            raise NormswapError(f"{src} has no config.json; it is not a Hugging Face checkpoint directory")
        return path
    if not _HUB_ID.match(str(src)):
        raise NormswapError(f"{src} does not exist and is not a Hugging Face hub id")
    return _download(str(src), trust_remote_code=trust_remote_code)


def _download(repo_id: str, *, trust_remote_code: bool) -> Path:
    import logging

    from huggingface_hub import snapshot_download

    # The hub client logs every retry; one line from us says it all.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    patterns = ["*.json", "*.txt", "*.model", "*.tiktoken"] + (["*.py"] if trust_remote_code else [])
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns + ["*.safetensors"]))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=patterns + ["*.bin"]))
        return path
    except Exception as error:  # the hub client raises many types; all mean "could not fetch"
        reason = _first_line(error)
        if "Name or service not known" in reason or "connect" in reason.lower() or "internet" in reason.lower():
            reason = "the Hugging Face Hub is unreachable"
        raise NormswapError(
            f"could not fetch '{repo_id}' ({reason[:160]}); pass a local checkpoint directory instead"
        ) from None


def read_config(path: Path) -> dict:
    """The checkpoint's config.json as a dict."""
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise NormswapError(f"cannot read {path / 'config.json'}: {error}") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, known before reading it."""

    name: str
    shard: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * _itemsize(self.dtype)


class SafetensorsShard:
    """One safetensors file: its header parsed and checked at open, tensors read on demand.

    The file is ``[8-byte little-endian header length n][n bytes of JSON][data]``; each header
    entry gives a tensor's dtype, shape and ``data_offsets`` [begin, end) into the data section.
    A header that does not parse, or promises bytes the file does not have (a truncated
    download), is reported at once as a ``NormswapError``.
    """

    MAX_HEADER_BYTES = 100 * 1024 * 1024

    def __init__(self, file: Path) -> None:
        self.file = file
        self._fd = os.open(file, os.O_RDONLY)
        try:
            self.entries = self._parse_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _corrupt(self, why: str) -> NormswapError:
        return NormswapError(f"weight file {self.file} is corrupt or truncated: {why}")

    def _parse_header(self) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._corrupt(f"{size} bytes, too short for a safetensors header")
        length = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if length > min(size - 8, self.MAX_HEADER_BYTES):
            raise self._corrupt(f"header length {length} does not fit in the file's {size} bytes")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._corrupt(f"unreadable header ({error})") from None
        if not isinstance(header, dict):
            raise self._corrupt("the header is not a JSON object")
        self.data_start = 8 + length
        entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            entries[name] = self._check_entry(name, entry, size - self.data_start)
        return entries

    def _check_entry(self, name: str, entry: object, data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            dtype = _safetensors_dtypes()[entry["dtype"]]
            shape = tuple(int(size) for size in entry["shape"])
            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._corrupt(f"bad header entry for {name}") from None
        count = 1
        for size in shape:
            count *= size
        if end - begin != count * _itemsize(dtype) or begin < 0:
            raise self._corrupt(f"{name}: data_offsets {begin}..{end} do not match shape {list(shape)}")
        if end > data_bytes:
            raise self._corrupt(f"{name} ends at byte {end} of a data section of {data_bytes} bytes")
        return dtype, shape, begin, end

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, copied from the file into fresh memory."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        self._pread(name, buffer, begin)
        return buffer.view(dtype).reshape(shape)

    def read_rows(self, name: str, start: int, count: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start``..``start+count`` (along the first axis) of ``name``, read into ``buffer``
        (a uint8 tensor, reused by the caller) when given."""
        import torch

        dtype, shape, begin, end = self.entries[name]
        row = (end - begin) // shape[0]
        raw = torch.empty(row * count, dtype=torch.uint8) if buffer is None else buffer[: row * count]
        self._pread(name, raw, begin + start * row)
        return raw.view(dtype).reshape(count, *shape[1:])

    def _pread(self, name: str, into: torch.Tensor, offset: int) -> None:
        view = memoryview(into.numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], self.data_start + offset + done)
            if got <= 0:
                raise self._corrupt(f"{name} ends early (the file shrank while it was read)")
            done += got

    def locate(self, name: str) -> tuple[int, int]:
        """The open file descriptor and absolute offset of the bytes of ``name``."""
        _, _, begin, _ = self.entries[name]
        return self._fd, self.data_start + begin

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint directory.

    Safetensors shards are read tensor by tensor (``SafetensorsShard``). Pickled ``.bin`` shards
    are loaded with ``weights_only=True`` (no arbitrary code) and ``mmap=True``, one shard at a
    time: their tensors are views of the mapped file, so memory holds the pages touched in the
    current shard, never a whole model.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shards = _weight_shards(path)
        self.is_safetensors = self.shards[0].endswith(".safetensors")
        self._open: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            for shard in self.shards:
                for info in self._scan(shard):
                    self.tensors[info.name] = info
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._open.values():
            if isinstance(handle, SafetensorsShard):
                handle.close()
        self._open.clear()

    def _scan(self, shard: str) -> Iterator[TensorInfo]:
        if shard.endswith(".safetensors"):
            for name, (dtype, shape, _, _) in self._handle(shard).entries.items():
                yield TensorInfo(name, shard, dtype, shape)
        else:
            for name, tensor in self._handle(shard).items():
                yield TensorInfo(name, shard, tensor.dtype, tuple(tensor.shape))

    def _handle(self, shard: str):
        if shard not in self._open:
            file = self.path / shard
            try:
                if shard.endswith(".safetensors"):
                    self._open[shard] = SafetensorsShard(file)
                else:
                    # bin shards are whole pickles; keep only one mapped at a time
                    self._open = {k: v for k, v in self._open.items() if k.endswith(".safetensors")}
                    self._open[shard] = _load_pickle_shard(file)
            except NormswapError:
                raise
            except Exception as error:
                raise NormswapError(f"cannot read weight file {file}: {_first_line(error)}") from None
        return self._open[shard]

    def get(self, name: str) -> torch.Tensor:
        """The tensor called ``name``, read from disk now."""
        info = self.tensors[name]
        try:
            if self.is_safetensors:
                return self._handle(info.shard).read(name)
            return self._handle(info.shard)[name]
        except NormswapError:
            raise
        except Exception as error:
            raise NormswapError(f"cannot read tensor {name} from {info.shard}: {_first_line(error)}") from None

    def read_rows(self, name: str, start: int, count: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start``..``start+count`` of ``name`` along its first axis, read now (into
        ``buffer``, a reusable uint8 tensor, for safetensors shards)."""
        info = self.tensors[name]
        try:
            if self.is_safetensors:
                return self._handle(info.shard).read_rows(name, start, count, buffer)
            return self._handle(info.shard)[name].narrow(0, start, count)
        except NormswapError:
            raise
        except Exception as error:
            raise NormswapError(f"cannot read tensor {name} from {info.shard}: {_first_line(error)}") from None

    def read_as(self, name: str, dtype: torch.dtype, slice_bytes: int = 8 << 20) -> torch.Tensor:
        """The tensor ``name`` converted to ``dtype``, read in row slices of about ``slice_bytes``,
        so that the source-dtype copy never exists whole beside the converted one."""
        import torch

        info = self.tensors[name]
        if len(info.shape) == 0 or info.shape[0] == 0 or info.nbytes <= slice_bytes:
            return self.get(name).to(dtype)
        out = torch.empty(info.shape, dtype=dtype)
        rows = max(1, slice_bytes // (info.nbytes // info.shape[0]))
        buffer = torch.empty(rows * (info.nbytes // info.shape[0]), dtype=torch.uint8)
        for start in range(0, info.shape[0], rows):
            count = min(rows, info.shape[0] - start)
            out.narrow(0, start, count).copy_(self.read_rows(name, start, count, buffer))
        return out

    def locate(self, name: str) -> tuple[int, int] | None:
        """(file descriptor, offset) of the raw bytes of ``name`` in a safetensors shard, else None."""
        if not self.is_safetensors:
            return None
        return self._handle(self.tensors[name].shard).locate(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, read now (for small models and tests)."""
        return {name: self.get(name) for name in self.tensors}


def _load_pickle_shard(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, memory-mapped, with no code run (``weights_only``)."""
    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "zip" not in str(error).lower() and "mmap" not in str(error).lower():
            raise
        # pickles from before torch 1.6 (not zip archives) cannot be mapped: load that shard whole
        state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise NormswapError(f"{file} does not hold a state dict")
    return state


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _weight_shards(path: Path) -> list[str]:
    """Weight file names of a checkpoint, preferring safetensors."""
    for index_name in (SAFETENSORS_INDEX, PICKLE_INDEX):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
                raise NormswapError(f"cannot read {index}: {error}") from None
            shards = sorted(set(weight_map.values()))
            missing = [shard for shard in shards if not (path / shard).is_file()]
            if missing:
                raise NormswapError(f"{path} is missing weight file {missing[0]} named in {index_name}")
            return shards
    for single in (SAFETENSORS_FILE, PICKLE_FILE):
        if (path / single).is_file():
            return [single]
    raise NormswapError(
        f"{path} has no weights: expected {SAFETENSORS_FILE}, a sharded {SAFETENSORS_INDEX}, or {PICKLE_FILE}"
    )


@cache
def _safetensors_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }


def __getattr__(name: str):
    if name == "SAFETENSORS_DTYPE_NAMES":  # built on first use, with torch
        return {dtype: key for key, dtype in _safetensors_dtypes().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StateDictReader:
    """The ``CheckpointReader`` interface over tensors already in memory (``convert_model``)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], shard: str = "model.safetensors") -> None:
        self._state = state_dict
        self.tensors = {
            name: TensorInfo(name, shard, tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()
        }

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]

    def close(self) -> None:
        pass
