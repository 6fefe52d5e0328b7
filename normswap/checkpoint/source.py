"""Load: find a checkpoint and read its tensors lazily.

``resolve_source`` turns what the user typed (a local directory, a hub id, or the bundled example)
into a local directory. ``CheckpointReader`` opens its weight files without reading them: tensors
are fetched one at a time (safetensors shards by positioned reads, ``safetensors_io``), so a
conversion never holds more than the group of tensors it is working on.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from normswap.checkpoint.bounded import read_json, read_json_once
from normswap.checkpoint.files import check_files, check_utf8_path, inside_file
from normswap.checkpoint.pickle_io import load_pickle_shard
from normswap.checkpoint.reads import RecentReads as RecentReads  # re-exported for the writer
from normswap.checkpoint.safetensors_io import SafetensorsShard, StoredTensor
from normswap.checkpoint.side_files import check_side_files
from normswap.dtypes import dtype_name, is_floating
from normswap.errors import NormswapError, first_line, quoted

if TYPE_CHECKING:  # torch is imported where tensors are read: resolving a source stays light
    import numpy
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
        check_side_files(path)
        return path
    path = Path(src).expanduser()
    if path.exists():
        check_utf8_path(Path(os.path.abspath(path)), "the checkpoint")
        if not path.is_dir():
            raise NormswapError(f"{src} is not a directory; pass a checkpoint directory or a hub id")
        if not (path / "config.json").is_file():
            what = "a config.json that is not a regular file" if (path / "config.json").exists() else "no config.json"
            raise NormswapError(f"{src} has {what}; it is not a Hugging Face checkpoint directory")
        if revision is not None:
            raise NormswapError(f"--revision applies to hub ids, not to the local directory {src}")
        check_files(path)
        check_side_files(path)
        return path
    if not _HUB_ID.match(str(src)):
        raise NormswapError(f"{src} does not exist and is not a Hugging Face hub id")
    from normswap.checkpoint.hub import download

    path = download(str(src), trust_remote_code=trust_remote_code, revision=revision)
    check_utf8_path(path, "the hub cache's copy")
    check_files(path)
    check_side_files(path)
    return path


def read_config(path: Path) -> dict:
    """The checkpoint's config.json as a dict (read within ``bounded.read_json``'s bounds, once per
    command while the file is unchanged: ``bounded.read_json_once``)."""
    inside_file(path, "config.json")  # a link out of the checkpoint, or not a regular file: refused
    return read_json_once(path / "config.json")


@dataclass(frozen=True)
class TensorInfo(StoredTensor):
    """Where a tensor lives and what it is, known before reading it.

    The dtype is kept by name (``float32``; a ``torch.dtype`` given is stored as its name), so that
    planning needs no torch; ``dtype`` is the ``torch.dtype`` itself.
    """

    name: str
    shard: str
    dtype_name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", dtype_name(self.dtype_name))


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint directory.

    Safetensors shards are read tensor by tensor (``SafetensorsShard``). Pickled ``.bin`` shards
    are loaded with ``weights_only=True`` (no arbitrary code) and ``mmap=True``, one shard at a
    time: their tensors are views of the mapped file, so memory holds the pages touched in the
    current shard, never a whole model. A ``mapped`` reader reads rows of safetensors shards over
    the file's mapped pages (``read_rows``), for a process that runs nothing else.

    A checkpoint may have more shards than a process may hold open files (1,024 is a common soft
    limit): at most ``MAX_OPEN_SHARDS`` safetensors shards are open at once, the least recently
    used closed to open another, and a shard opened again must be the file first opened
    (``SafetensorsShard.reopen``). A shard being read is held open meanwhile (``holding``), by
    whichever thread reads it.
    """

    MAX_OPEN_SHARDS = 32

    def __init__(self, path: Path, mapped: bool = False) -> None:
        self.path, self.mapped = path, mapped
        self.shards = _weight_shards(path)
        self.is_safetensors = self.shards[0].endswith(".safetensors")
        self._open: dict[str, SafetensorsShard] = {}  # every safetensors shard read so far, open or closed
        self._pickled: dict[str, dict[str, torch.Tensor]] = {}  # the one bin shard mapped now
        self._recent: OrderedDict[str, None] = OrderedDict()  # the open safetensors shards, least recently used first
        self._held: dict[str, int] = {}  # shard -> the reads holding it open
        self._pool_lock = threading.Lock()
        self.tensors: dict[str, TensorInfo] = {}
        self._staging: torch.Tensor | None = None  # ``read_as``'s slice buffer
        self._staging_lock = threading.Lock()
        try:
            for shard in self.shards:
                for info in self._scan(shard):
                    if info.name in self.tensors:
                        raise NormswapError(f"{path}: tensor {info.name} is in both {self.tensors[info.name].shard} "
                                            f"and {shard}")
                    self.tensors[info.name] = info
            if not any(is_floating(info.dtype_name) for info in self.tensors.values()):
                raise NormswapError(f"{path} has no weights: its weight files ({', '.join(self.shards)}) name no "
                                    "floating-point tensor")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._pool_lock:
            for handle in self._open.values():
                handle.close()
            self._open.clear()
            self._recent.clear()
            self._pickled.clear()

    def _scan(self, shard: str) -> Iterator[TensorInfo]:
        if shard.endswith(".safetensors"):
            with self._holding_shard(shard) as handle:
                entries = handle.entries
            for name, (dtype, shape, _, _) in entries.items():
                yield TensorInfo(name, shard, dtype, shape)
        else:
            for name, tensor in self._pickle(shard).items():
                yield TensorInfo(name, shard, tensor.dtype, tuple(tensor.shape))

    def _pickle(self, shard: str) -> dict[str, torch.Tensor]:
        """A bin shard's tensors: whole pickles, so only one is kept mapped at a time."""
        if shard not in self._pickled:
            with _read_errors(f"weight file {self.path / shard}"):
                self._pickled = {shard: load_pickle_shard(self.path / shard)}
        return self._pickled[shard]

    @contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """The safetensors shard of tensor ``name`` held open while the block runs (so that a
        descriptor from ``locate`` stays valid); nothing for other sources."""
        if not self.is_safetensors:
            yield
            return
        with self._holding_shard(self.tensors[name].shard):
            yield

    @contextmanager
    def _holding_shard(self, shard: str) -> Iterator[SafetensorsShard]:
        """``shard``'s handle, open and kept open until the block ends; shards no read holds are
        closed, least recently used first, down to ``MAX_OPEN_SHARDS`` open."""
        with self._pool_lock, _read_errors(f"weight file {self.path / shard}"):
            handle = self._open.get(shard)
            if handle is None:
                handle = self._open[shard] = SafetensorsShard(self.path / shard)
            else:
                handle.reopen()
            self._recent[shard] = None
            self._recent.move_to_end(shard)
            self._held[shard] = self._held.get(shard, 0) + 1
        try:
            yield handle
        finally:
            with self._pool_lock:
                self._held[shard] -= 1
                idle = [name for name in self._recent if not self._held.get(name)]
                for name in idle[: max(0, len(self._recent) - self.MAX_OPEN_SHARDS)]:
                    del self._recent[name]
                    self._open[name].close()

    def get(self, name: str) -> torch.Tensor:
        """The tensor called ``name``, read from disk now."""
        info = self.tensors[name]
        if not self.is_safetensors:
            with _read_errors(f"tensor {name} from {info.shard}"):
                return self._pickle(info.shard)[name]
        with self._holding_shard(info.shard) as handle, _read_errors(f"tensor {name} from {info.shard}"):
            return handle.read(name)

    def read_array(self, name: str) -> numpy.ndarray:
        """The tensor ``name`` as a numpy array, read now (without torch from safetensors shards)."""
        if self.is_safetensors:
            shard = self.tensors[name].shard
            with self._holding_shard(shard) as handle, _read_errors(f"tensor {name} from {shard}"):
                return handle.read_array(name)
        return self.get(name).float().numpy()

    def read_rows(self, name: str, start: int, count: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start``..``start+count`` of ``name`` along its first axis, read now (into
        ``buffer``, a reusable uint8 tensor, for safetensors shards; for a ``mapped`` reader, over
        the file's mapped pages instead, with no copy: ``SafetensorsShard.mapped_rows``)."""
        info = self.tensors[name]
        if not self.is_safetensors:
            with _read_errors(f"tensor {name} from {info.shard}"):
                return self._pickle(info.shard)[name].narrow(0, start, count)
        with self._holding_shard(info.shard) as handle, _read_errors(f"tensor {name} from {info.shard}"):
            if self.mapped:
                return handle.mapped_rows(name, start, count)
            return handle.read_rows(name, start, count, buffer)

    def read_as(self, name: str, dtype: torch.dtype, slice_bytes: int = 8 << 20,
                empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor ``name`` converted to ``dtype``, read in row slices of about ``slice_bytes``,
        so that the source-dtype copy never exists whole beside the converted one. ``empty(shape,
        dtype)`` makes the output tensor (``memory.BufferPool.empty`` reuses memory), by default
        ``torch.empty``."""
        import torch

        info = self.tensors[name]
        # A tensor of no bytes has no rows to walk, whatever its first dimension says ([2**62, 0]):
        # past this test every dimension is at least 1, so the loop runs at most ``nbytes`` times.
        if len(info.shape) == 0 or info.nbytes == 0 or not self.is_safetensors:
            return self.get(name).to(dtype)
        out = torch.empty(info.shape, dtype=dtype) if empty is None else empty(tuple(info.shape), dtype)
        rows = max(1, slice_bytes // (info.nbytes // info.shape[0]))
        with self._staging_lock:  # one slice buffer, kept: fresh buffers fault in new pages every read
            row = info.nbytes // info.shape[0]
            if self._staging is None or self._staging.numel() < rows * row:
                self._staging = torch.empty(max(slice_bytes, rows * row), dtype=torch.uint8)
            for start in range(0, info.shape[0], rows):
                count = min(rows, info.shape[0] - start)
                out.narrow(0, start, count).copy_(self.read_rows(name, start, count, self._staging))
        return out

    def locate(self, name: str) -> tuple[int, int] | None:
        """(file descriptor, offset) of the raw bytes of ``name`` in a safetensors shard, else None.
        The descriptor is valid while the block of ``holding(name)`` runs, and no longer."""
        if not self.is_safetensors:
            return None
        with self._holding_shard(self.tensors[name].shard) as handle:
            return handle.locate(name)


def source_inputs(source_dir: Path) -> list[Path]:
    """The source folder and the real files behind its entries (hub caches link to blobs
    elsewhere): what no output may contain or lie inside."""
    inputs = [source_dir]
    try:
        entries = list(source_dir.iterdir())
    except OSError:
        return inputs
    for entry in entries:
        if entry.is_symlink():
            inputs.append(Path(os.path.realpath(entry)))
    return inputs


def first_non_finite(path: Path) -> str | None:
    """The first floating tensor of the checkpoint at ``path`` holding NaN or inf, read one at a time."""
    import torch

    with CheckpointReader(path) as reader:
        for name, info in reader.tensors.items():
            if info.dtype.is_floating_point and not bool(torch.isfinite(reader.get(name)).all()):
                return name
    return None


@contextmanager
def _read_errors(what: str) -> Iterator[None]:
    """Any failure to read ``what`` (other than normswap's own refusals) as one line."""
    try:
        yield
    except NormswapError:
        raise
    except Exception as error:
        raise NormswapError(f"cannot read {what}: {first_line(error)}") from None


def _weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map``: tensor name -> shard file name, a plain name in the checkpoint
    folder (the file itself may be a link, as in the hub cache)."""
    data = read_json(index, mapping=False, unique_keys=True)  # a tensor named twice has no one shard
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise NormswapError(f"{index}: 'weight_map' must be a mapping of tensor names to shard files")
    if not weight_map:
        raise NormswapError(f"{index}: 'weight_map' names no tensor")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise NormswapError(f"{index}: the shard of {name} must be a file name (got {shard!r:.40})")
        parts = shard.replace("\\", "/").split("/")
        if (not shard or shard.startswith(("/", "~")) or any(part in ("", ".", "..") for part in parts)
                or not shard.isprintable()):
            raise NormswapError(f"{index}: the shard of {name}, {shard!r:.60}, is not a file name in the checkpoint folder")
    return weight_map


def _weight_shards(path: Path) -> list[str]:
    """Weight file names of a checkpoint, in ``from_pretrained``'s order (single safetensors file,
    its index, ``.bin``, its index), so that normswap and transformers read the same weights. A
    single file beside an index of the same format is refused: which one is meant is ambiguous."""
    for single, index_name in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (PICKLE_FILE, PICKLE_INDEX)):
        index = path / index_name
        has_single, has_index = os.path.lexists(path / single), os.path.lexists(index)
        if has_single and has_index:
            raise NormswapError(f"{path} holds both {single} and {index_name}: two sets of weights, and which one is "
                                f"meant is ambiguous (transformers reads {single}); remove one")
        inside_file(path, single if has_single else index_name)
        if has_single:
            return [single]
        if has_index:
            shards = sorted(set(_weight_map(index).values()))
            missing = [shard for shard in shards if inside_file(path, shard) is None]
            if missing:
                raise NormswapError(f"{path} is missing weight file {quoted(missing[0])} named in {index_name}")
            return shards
    raise NormswapError(
        f"{path} has no weights: expected {SAFETENSORS_FILE}, a sharded {SAFETENSORS_INDEX}, or {PICKLE_FILE}"
    )


class StateDictReader:
    """The ``CheckpointReader`` interface over tensors already in memory (``convert_model``)."""

    # No file behind the tensors: the writer computes each one rather than copying bytes.
    is_safetensors = False

    def __init__(self, state_dict: dict[str, torch.Tensor], shard: str = "model.safetensors") -> None:
        self._state = state_dict
        self.tensors = {
            name: TensorInfo(name, shard, tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()
        }

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]

    def close(self) -> None:
        pass
