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


def resolve_source(src: str | Path, *, trust_remote_code: bool = False, revision: str | None = None) -> Path:
    """A local directory in Hugging Face layout for ``src``.

    ``src`` is a local directory, the bundled example (``normswap:austen-gpt2``), or a hub id
    that is downloaded (at ``revision``: a branch, tag or commit; default the main branch) when
    the hub is reachable, or read from the local hub cache. Only top-level configuration,
    tokenizer and weight files are fetched; Python files only with ``trust_remote_code``.
    """
    if str(src) == EXAMPLE_MODEL:
        path = example_model_path()
        if not (path / "config.json").is_file():
            raise NormswapError(f"the bundled example model is missing from this install ({path})")
        if revision is not None:
            raise NormswapError("--revision applies to hub ids, not to the bundled example")
        return path
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NormswapError(f"{src} is not a directory; pass a checkpoint directory or a hub id")
        if not (path / "config.json").is_file():
            raise NormswapError(f"{src} has no config.json; it is not a Hugging Face checkpoint directory")
        if revision is not None:
            raise NormswapError(f"--revision applies to hub ids, not to the local directory {src}")
        return path
    if not _HUB_ID.match(str(src)):
        raise NormswapError(f"{src} does not exist and is not a Hugging Face hub id")
    return _download(str(src), trust_remote_code=trust_remote_code, revision=revision)


# What the hub client's errors mean, by class name, in the one line the user reads.
_HUB_ERRORS = {
    "RepositoryNotFoundError": "repository not found (or private: log in with `hf auth login`)",
    "GatedRepoError": "the repository is gated: accept its terms on the hub and log in with `hf auth login`",
    "RevisionNotFoundError": "revision not found",
    "OfflineModeIsEnabled": "offline mode is on (HF_HUB_OFFLINE) and it is not in the local cache",
}


def _download(repo_id: str, *, trust_remote_code: bool, revision: str | None = None) -> Path:
    import logging

    from huggingface_hub import snapshot_download

    # The hub client logs every retry; one line from us says it all.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    patterns = ["*.json", "*.txt", "*.model", "*.tiktoken"] + (["*.py"] if trust_remote_code else [])
    # Top-level files only: onnx/, openvino/ and the like hold other exports of the same model.
    options = {"revision": revision, "ignore_patterns": ["*/*"]}
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns + ["*.safetensors"], **options))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=patterns + ["*.bin"], **options))
        return path
    except Exception as error:  # the hub client raises many types; all mean "could not fetch"
        raise NormswapError(
            f"could not fetch '{repo_id}'{f' at revision {revision}' if revision else ''} ({_hub_reason(error)}); "
            "pass a local checkpoint directory instead"
        ) from None


def _hub_reason(error: BaseException) -> str:
    """The cause of a failed download, in a few words."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    names = [type(e).__name__ for e in chain]
    if "OfflineModeIsEnabled" in names or any("offline" in _first_line(e).lower() for e in chain[:1]):
        return _HUB_ERRORS["OfflineModeIsEnabled"]
    for name in names:
        if name in _HUB_ERRORS:
            return _HUB_ERRORS[name]
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status in (401, 403):
        return _HUB_ERRORS["GatedRepoError"]
    reason = _first_line(error)
    connection = ("ConnectError", "ConnectionError", "RemoteProtocolError", "ReadError", "TimeoutException",
                  "ConnectTimeout", "ReadTimeout", "LocalEntryNotFoundError")
    if any(name in connection for name in names) or "Name or service not known" in reason or "connect" in reason.lower():
        return f"the Hugging Face Hub is unreachable at {_endpoint()}"
    sentence = reason.split(". ")[0].rstrip(".")
    if len(sentence) > 160:  # the client's messages run to paragraphs; cut at a word
        sentence = sentence[:160].rsplit(" ", 1)[0] + " ..."
    return sentence


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def read_config(path: Path) -> dict:
    """The checkpoint's config.json as a dict."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NormswapError(f"cannot read {file}: {_first_line(error)}") from None
    if not isinstance(config, dict):
        kind = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
        raise NormswapError(f"{file} must hold a JSON object, not {kind.get(type(config), 'null')}")
    return config


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
        data_bytes = size - self.data_start
        entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            entries[name] = self._check_entry(name, entry, data_bytes)
        self._check_layout(entries, data_bytes)
        return entries

    def _check_entry(self, name: str, entry: object, data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._corrupt(f"header entry {name} is not a mapping with dtype, shape and data_offsets")
        dtype = _safetensors_dtypes().get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise self._corrupt(f"{name} has dtype {entry['dtype']!r:.40}, which normswap does not read")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_natural(size) for size in shape):
            raise self._corrupt(f"{name} has shape {shape!r:.60}; dimensions must be non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(offset) for offset in offsets):
            raise self._corrupt(f"{name} has data_offsets {offsets!r:.60}; they must be two non-negative integers")
        shape, (begin, end) = tuple(shape), offsets
        count = 1
        for size in shape:
            count *= size
        if end - begin != count * _itemsize(dtype):
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
                    if info.name in self.tensors:
                        raise NormswapError(f"{path}: tensor {info.name} is in both {self.tensors[info.name].shard} "
                                            f"and {shard}")
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


def first_non_finite(path: Path) -> str | None:
    """The first floating tensor of the checkpoint at ``path`` holding NaN or inf, read one at a time."""
    import torch

    with CheckpointReader(path) as reader:
        for name, info in reader.tensors.items():
            if info.dtype.is_floating_point and not bool(torch.isfinite(reader.get(name)).all()):
                return name
    return None


def _load_pickle_shard(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, memory-mapped, with no code run (``weights_only``)."""
    import pickle

    import torch

    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "zip" not in str(error).lower() and "mmap" not in str(error).lower():
                raise
            # pickles from before torch 1.6 (not zip archives) cannot be mapped: load that shard whole
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises turning the safety off; normswap never does
        raise NormswapError(f"{file} holds Python objects other than tensors; normswap reads only tensors from "
                            ".bin files and runs no code from them") from None
    if not isinstance(state, dict):
        raise NormswapError(f"{file} does not hold a state dict")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise NormswapError(f"{file}: entry {name!r:.60} holds a {type(value).__name__}, not a tensor")
    return state


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map``: tensor name -> shard file name, a plain name in the checkpoint
    folder (the file itself may be a link, as in the hub cache)."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NormswapError(f"cannot read {index}: {_first_line(error)}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise NormswapError(f"{index}: 'weight_map' must be a mapping of tensor names to shard files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise NormswapError(f"{index}: the shard of {name} must be a file name (got {shard!r:.40})")
        parts = shard.replace("\\", "/").split("/")
        if not shard or shard.startswith(("/", "~")) or any(part in ("", ".", "..") for part in parts):
            raise NormswapError(f"{index}: the shard of {name}, {shard!r:.60}, is not a file name in the checkpoint folder")
    return weight_map


def _weight_shards(path: Path) -> list[str]:
    """Weight file names of a checkpoint, preferring safetensors."""
    for index_name in (SAFETENSORS_INDEX, PICKLE_INDEX):
        index = path / index_name
        if index.is_file():
            shards = sorted(set(_weight_map(index).values()))
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
