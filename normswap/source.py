"""Load: find a checkpoint and read its tensors lazily.

``resolve_source`` turns what the user typed (a local directory, a Hugging Face hub id, or the
bundled example) into a local directory. ``CheckpointReader`` opens the weight files of that
directory without reading them: tensors are fetched one at a time, so a conversion never holds
more than the group of tensors it is working on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from normswap.errors import NormswapError

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
        return count * torch.empty((), dtype=self.dtype).element_size()


class CheckpointReader:
    """Lazy, read-only access to the tensors of a checkpoint directory.

    Safetensors shards are memory-mapped with ``safe_open``. Pickled ``.bin`` shards are loaded
    with ``weights_only=True`` (no arbitrary code) and ``mmap=True``, one shard at a time.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shards = _weight_shards(path)
        self.is_safetensors = self.shards[0].endswith(".safetensors")
        self._stack = ExitStack()
        self._open: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shards:
            for info in self._scan(shard):
                self.tensors[info.name] = info

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def _scan(self, shard: str) -> Iterator[TensorInfo]:
        if shard.endswith(".safetensors"):
            handle = self._handle(shard)
            for name in handle.keys():
                view = handle.get_slice(name)
                yield TensorInfo(name, shard, _SAFETENSORS_DTYPES[view.get_dtype()], tuple(view.get_shape()))
        else:
            for name, tensor in self._handle(shard).items():
                yield TensorInfo(name, shard, tensor.dtype, tuple(tensor.shape))

    def _handle(self, shard: str):
        if shard not in self._open:
            file = self.path / shard
            try:
                if shard.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[shard] = self._stack.enter_context(safe_open(str(file), framework="pt"))
                else:
                    # bin shards are whole pickles; keep only one mapped at a time
                    self._open = {k: v for k, v in self._open.items() if k.endswith(".safetensors")}
                    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                    if not isinstance(state, dict):
                        raise NormswapError(f"{file} does not hold a state dict")
                    self._open[shard] = state
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
                return self._handle(info.shard).get_tensor(name)
            return self._handle(info.shard)[name]
        except NormswapError:
            raise
        except Exception as error:
            raise NormswapError(f"cannot read tensor {name} from {info.shard}: {_first_line(error)}") from None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, read now (for small models and tests)."""
        return {name: self.get(name) for name in self.tensors}


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


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
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
SAFETENSORS_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


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
