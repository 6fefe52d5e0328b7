"""Models on the meta device, run with their weights read from the checkpoint one unit at a time.

The original and the converted model are each built on the meta device (accelerate's
``init_empty_weights``) and dispatched with accelerate's ``dispatch_model``: each layer of a
residual block (``block_units``), and every module outside the block list, is one unit of the
``device_map``, offloaded, with the checkpoint itself as the offload store (``Float32Weights``:
tensors read from the shards on demand; nothing is copied to an offload folder). accelerate's
hooks then load a unit's weights just before it runs and drop them right after, so memory holds
one unit at a time: a block of rows of a linear layer's weight (``RowBlocks``: at most
``LAYER_SLICE_BYTES`` in float32, whatever the width), a few rows of the embedding, or a slice of
the head. With a GPU present the execution device is the GPU, else the CPU.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.checkpoint.names import canonical_names
from normswap.checkpoint.source import CheckpointReader, read_config
from normswap.errors import NormswapError
from normswap.memory import map_large_allocations, release_memory
from normswap.modeling import build, online
from normswap.runtime.lockstep import SharedHead, SharedReads

if TYPE_CHECKING:
    import transformers

# Above this many bytes of float32 weights, automatic verification goes layer by layer
# (a whole-model comparison holds one float32 copy of the model).
LAYERWISE_ABOVE_BYTES = 1 << 30
# A linear layer of a block whose float32 weight is bigger is loaded this many bytes of rows at a time.
LAYER_SLICE_BYTES = 16 << 20


def float32_bytes(path: Path) -> int:
    """Bytes the floating-point weights of the checkpoint at ``path`` take in float32."""
    with CheckpointReader(path) as reader:
        return 4 * sum(math.prod(info.shape) for info in reader.tensors.values() if info.dtype.is_floating_point)


def wants_layerwise(path: Path) -> bool:
    """Whether automatic verification of the checkpoint at ``path`` should go layer by layer."""
    return float32_bytes(path) > LAYERWISE_ABOVE_BYTES


def execution_device() -> torch.device:
    """Where blocks run: the first GPU when there is one, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' and accelerate's load-time chatter."""
    loggers = [logging.getLogger(name) for name in ("transformers", "accelerate")]
    levels = [logger.level for logger in loggers]
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def empty_model(cls: type, config: transformers.PretrainedConfig, layers: int | None = None) -> nn.Module:
    """``cls`` built with its parameters on meta (buffers stay real), in float32, eval mode; with
    ``layers``, its first ``layers`` blocks only (``first_blocks``)."""
    from accelerate import init_empty_weights

    first_blocks(config, layers)
    with _quiet(), init_empty_weights():
        model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
    return _float32_tied(model)


def first_blocks(config: transformers.PretrainedConfig, layers: int | None) -> None:
    """Have ``config`` build the first ``layers`` blocks of its model (``num_hidden_layers``):
    the model of those blocks, each with its own index, kind and weight names, the final norm and
    the head. Whether the class obeyed is for the caller to check (``find_blocks``)."""
    if layers is not None:
        config.num_hidden_layers = layers


def original_model(path: Path, architecture: Architecture, config: dict | None = None,
                   layers: int | None = None) -> nn.Module:
    """The original checkpoint's model class, empty (``config``: its config.json, if read already;
    ``layers``: build that many first blocks only)."""
    config = read_config(path) if config is None else config
    return empty_model(build.model_class(config, architecture.auto_class), build.config_object(config), layers)


def converted_model(path: Path, architecture: Architecture, how: str, config: dict | None = None,
                    layers: int | None = None) -> nn.Module:
    """The converted checkpoint's model, empty: the stock class (``stock``), normswap's RMSNorm
    class (``rmsnorm``), or the checkpoint's own code (``remote``, runs it). ``config``: its
    config.json, if read already; ``layers``: build that many first blocks only."""
    import transformers

    if how == "stock":
        return empty_model(build.model_class(read_config(path) if config is None else config, architecture.auto_class),
                           transformers.AutoConfig.from_pretrained(path), layers)
    if how == "rmsnorm":
        from normswap.runtime.loaders import rmsnorm_class

        cls = rmsnorm_class(path, architecture, config)
        with _quiet():
            config = cls.config_class.from_pretrained(path)
        return empty_model(cls, config, layers)
    from accelerate import init_empty_weights

    online.check_config(read_config(path) if config is None else config, architecture.auto_class, path)
    with _quiet():
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
        first_blocks(config, layers)
        with init_empty_weights():
            model = getattr(transformers, architecture.auto_class).from_config(config, trust_remote_code=True)
    # a normswap_<type> config may resolve to normswap's kernel class, whose fused block forwards
    # read a norm's weight without calling the norm, bypassing accelerate's per-module weight loading
    from normswap.kernels.patch import unpatch

    return unpatch(_float32_tied(model))


def _float32_tied(model: nn.Module) -> nn.Module:
    """``model`` in float32 and eval mode, its tied weights tied (transformers ties them on loading;
    a meta model must say so too, and a dtype change on meta unties them)."""
    model = model.to(torch.float32).eval()
    with _quiet():
        model.tie_weights()
    return model


class Float32Weights(Mapping):
    """The parameters of ``model``, read from ``checkpoint`` on demand and converted to float32.

    This is the ``state_dict`` accelerate's offload hooks load each module from (any mapping
    will do). A tensor is read in row slices and converted into its float32 copy
    (``CheckpointReader.read_as``), so a float16 embedding never exists twice in memory.
    Checkpoint names are mapped to the class's names as the conversion plan maps them; a tied
    parameter missing from the checkpoint (GPT-2's head) reads the tensor it is tied to.
    """

    def __init__(self, model: nn.Module, reader: CheckpointReader, shared: SharedReads | None = None,
                 shared_key: Callable[[str], Hashable] = str) -> None:
        from accelerate.utils import find_tied_parameters

        self.reader, self.shared, self.shared_key = reader, shared, shared_key
        self.pool = shared.pool if shared is not None else None
        model_keys = set(model.state_dict().keys())
        names = canonical_names(list(reader.tensors), model_keys, model.base_model_prefix,
                                build.checkpoint_renamer(model))
        self.sources = {names[source]: source for source in reader.tensors}
        for group in find_tied_parameters(model):
            present = next((name for name in group if name in self.sources), None)
            for name in group:
                if present is not None and name not in self.sources:
                    self.sources[name] = self.sources[present]
        missing = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in self.sources]
        if missing:
            raise NormswapError(f"{reader.path} has no weight for {missing[0]}")
        self.rows: dict[str, tuple[str, int, int]] = {}  # a part's parameter -> (source, first row, rows)
        self._staging: torch.Tensor | None = None
        if shared is not None:
            shared.expect(shared_key(source) for source in self.sources.values())

    def split(self, name: str, parts: list[tuple[str, int, int]]) -> None:
        """Serve the parameter ``name`` as ``parts`` instead: (part's parameter, first row, rows)
        of its tensor, each read (and shared) on its own."""
        source = self.sources.pop(name)
        self.rows.update((part, (source, start, count)) for part, start, count in parts)
        if self.shared is not None:
            key = self.shared_key(source)
            self.shared.expected[key] -= 1
            self.shared.expect((key, start) for _, start, _ in parts)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.rows:
            source, start, count = self.rows[name]
            if self.shared is not None:
                return self.shared.get((self.shared_key(source), start), lambda: self._read_rows(source, start, count))
            return self._read_rows(source, start, count)
        source = self.sources[name]
        if self.shared is not None:
            return self.shared.get(self.shared_key(source), lambda: self._read(source))
        return self._read(source)

    def _read_rows(self, source: str, start: int, count: int) -> torch.Tensor:
        info = self.reader.tensors[source]
        shape = (count, *info.shape[1:])
        out = torch.empty(shape, dtype=torch.float32) if self.pool is None else self.pool.empty(shape, torch.float32)
        nbytes = count * (info.nbytes // info.shape[0])
        if self._staging is None or self._staging.numel() < nbytes:  # one buffer, reused part after part
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return out.copy_(self.reader.read_rows(source, start, count, self._staging))

    def _read(self, source: str) -> torch.Tensor:
        dtype = self.reader.tensors[source].dtype
        return self.reader.read_as(source, torch.float32 if dtype.is_floating_point else dtype,
                                   empty=None if self.pool is None else self.pool.empty)

    def __contains__(self, name: object) -> bool:
        # Mapping's default reads the tensor to answer; accelerate asks before every read.
        return name in self.sources or name in self.rows

    def __iter__(self) -> Iterator[str]:
        yield from self.sources
        yield from self.rows

    def __len__(self) -> int:
        return len(self.sources) + len(self.rows)


def find_blocks(model: nn.Module, path: str | None) -> tuple[str, nn.ModuleList] | None:
    """The residual blocks: the ModuleList at ``path``, or else the longest list of same-class modules."""
    if path is not None:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            return None
        return (path, blocks) if isinstance(blocks, nn.ModuleList) and len(blocks) else None
    candidates = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and len({type(child) for child in module}) == 1
    ]
    return max(candidates, key=lambda item: len(item[1]), default=None)


def device_map_for(model: nn.Module, blocks_path: str, device: str = "disk") -> dict[str, str]:
    """The ``device_map``, every unit on ``device``: the ``block_units`` of every block, and one
    unit per module outside the block list.

    Raises ``Unsupported`` when a module above the block list holds parameters of its own: such
    a parameter cannot be a unit of its own.
    """
    units: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        if any(True for _ in module.parameters(recurse=False)):
            raise Unsupported(f"'{prefix or 'the model'}' holds parameters beside the block list")
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full == blocks_path:
                for key, block in child._modules.items():
                    units.update(dict.fromkeys(block_units(block, f"{full}.{key}"), device))
            elif blocks_path.startswith(full + "."):
                visit(child, full)
            else:
                units[full] = device

    visit(model, "")
    return units


def block_units(block: nn.Module, prefix: str) -> list[str]:
    """The units one block is loaded in, by module path (``prefix``: the block's), in module
    order: each module that holds parameters or buffers of its own, or has no children, is one
    unit with everything below it; any other module is split into its children. A block of an
    nn.Linear stack loads one linear layer at a time: at OPT-6.7B's width that is fc1's 268 MB in
    float32, where the whole block is 805 MB."""
    if (next(block.parameters(recurse=False), None) is not None or next(block.buffers(recurse=False), None) is not None
            or not block._modules):
        return [prefix]
    return [unit for name, child in block._modules.items() if child is not None
            for unit in block_units(child, f"{prefix}.{name}")]


class _Rows(nn.Module):
    """One block of stored rows of a linear layer's weight (and its bias rows, or the whole bias),
    a unit of its own: ``RowBlocks``."""

    def __init__(self, rows: int, columns: int, bias: int | None, linear: bool) -> None:
        super().__init__()
        self.linear = linear
        self.weight = nn.Parameter(torch.empty(rows, columns, device="meta"), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(torch.empty(bias, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """nn.Linear's rows: their outputs, x·Wᵀ + b. Conv1D's (``into``: the sum so far, or None
        for the first block, which holds the bias): the sum plus x·W, x being the columns of the
        input that these rows multiply."""
        if self.linear:
            return nn.functional.linear(x, self.weight, self.bias)
        if into is not None:
            return into.addmm_(x, self.weight)
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)


class RowBlocks(nn.Module):
    """A linear layer computed from blocks of its weight's stored rows, each block a unit
    (``block_units``) that the offload hooks load just before it runs and drop right after:
    memory holds one block, not the layer (at OPT-6.7B's width, fc1 is 268 MB in float32).

    An nn.Linear weight [out, in] stores an output per row: each block gives its outputs,
    x·W_jᵀ + b_j, and they are concatenated (each output is the dot product the whole layer
    takes). transformers' Conv1D stores [in, out] (y = x·W + b) an input per row: the output is b
    plus Σ_j x_j·W_j over the blocks, x_j the columns of x that block j's rows multiply (float32
    sums in another order than one product's, which is within float32 rounding)."""

    def __init__(self, layer: nn.Module, rows: int) -> None:
        super().__init__()
        self.linear = isinstance(layer, nn.Linear)
        total, columns = layer.weight.shape
        bias = layer.bias
        self.starts = list(range(0, total, rows))
        self.parts = nn.ModuleList(
            _Rows(min(rows, total - start), columns,
                  None if bias is None else min(rows, total - start) if self.linear else (columns if not index else None),
                  self.linear)
            for index, start in enumerate(self.starts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear:
            return torch.cat([part(x) for part in self.parts], dim=-1)
        flat, out = x.reshape(-1, x.shape[-1]), None
        for part, start in zip(self.parts, self.starts, strict=True):
            out = part(flat[:, start: start + part.weight.shape[0]], out)
        return out.view(*x.shape[:-1], out.shape[-1])


def load_by_row_blocks(model: nn.Module, weights: Float32Weights, blocks_path: str,
                       slice_bytes: int | None = None) -> None:
    """Replace each linear layer (nn.Linear, transformers' Conv1D) of the blocks whose float32
    weight is bigger than ``slice_bytes`` (default ``LAYER_SLICE_BYTES``) by ``RowBlocks`` of at
    most that many bytes each, served by ``weights`` block by block. A weight another parameter
    is tied to stays whole. The model is consumed, as by ``stream_vocabulary``."""
    slice_bytes = LAYER_SLICE_BYTES if slice_bytes is None else slice_bytes
    readers: dict[str, int] = {}
    for source in weights.sources.values():
        readers[source] = readers.get(source, 0) + 1
    blocks = model.get_submodule(blocks_path)
    for name, layer in list(blocks.named_modules(prefix=blocks_path)):
        if not (isinstance(layer, nn.Linear) or type(layer).__name__ == "Conv1D") or not hasattr(layer, "weight"):
            continue
        source = weights.sources.get(f"{name}.weight")
        if source is None or readers[source] > 1 or layer.weight.dim() != 2:
            continue
        info = weights.reader.tensors[source]
        total, columns = layer.weight.shape
        if tuple(info.shape) != (total, columns) or not info.dtype.is_floating_point or 4 * total * columns <= slice_bytes:
            continue
        blocked = RowBlocks(layer, max(1, slice_bytes // (4 * columns)))
        counts = [part.weight.shape[0] for part in blocked.parts]
        weights.split(f"{name}.weight", [(f"{name}.parts.{index}.weight", start, count)
                                         for index, (start, count) in enumerate(zip(blocked.starts, counts, strict=True))])
        if layer.bias is not None and blocked.linear:
            weights.split(f"{name}.bias", [(f"{name}.parts.{index}.bias", start, count)
                                           for index, (start, count) in enumerate(zip(blocked.starts, counts, strict=True))])
        elif layer.bias is not None:
            weights.sources[f"{name}.parts.0.bias"] = weights.sources.pop(f"{name}.bias")
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, blocked)


class RowsFromCheckpoint(nn.Module):
    """An input embedding that reads only the rows it is asked for, from the checkpoint, in float32.

    A block-by-block pass would otherwise load the whole [vocab, d] table (for GPT-2-XL, 321 MB in
    float32) to look up the probe's 128 tokens."""

    def __init__(self, reader: CheckpointReader, source: str, device: torch.device) -> None:
        super().__init__()
        self.reader, self.source, self.device = reader, source, device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        unique, where = torch.unique(ids.cpu(), return_inverse=True)
        rows = torch.stack([self.reader.read_rows(self.source, int(row), 1)[0] for row in unique.tolist()])
        return rows.float()[where].to(self.device)


class HeadByVocabularyChunk(nn.Module):
    """A bias-free output head computed a slice of the vocabulary at a time, each slice's weight
    rows read from the checkpoint and converted to float32 just before use: memory holds one
    slice, not the [vocab, d] matrix.

    ``pass_key`` names the weight's bytes for a lockstep run (a ``SharedReads`` key; None outside
    one): heads of several models with the same key make one pass over the weight for all of
    them (``lockstep.SharedHead``, set as ``shared`` for the run)."""

    def __init__(self, reader: CheckpointReader, source: str, slice_bytes: int = 16 << 20,
                 pass_key: Hashable | None = None) -> None:
        super().__init__()
        self.reader, self.source, self.pass_key = reader, source, pass_key
        self.shared: SharedHead | None = None
        vocab, width = reader.tensors[source].shape
        self.vocab, self.rows = vocab, max(1, slice_bytes // (4 * width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared.logits(self, hidden)
        return self.pass_over([hidden])[0]

    def pass_over(self, hiddens: list[torch.Tensor]) -> list[torch.Tensor]:
        """The logits of each of ``hiddens``, in one pass over the weight: each slice is read and
        converted once, and multiplied by each input as a pass for that input alone would."""
        logits = [hidden.new_empty(*hidden.shape[:-1], self.vocab) for hidden in hiddens]
        info = self.reader.tensors[self.source]
        # one raw and one float32 slice, reused: fresh ones would fault in new pages every slice
        raw = torch.empty(self.rows * (info.nbytes // self.vocab), dtype=torch.uint8)
        weight = torch.empty(self.rows, info.shape[1], dtype=torch.float32, device=hiddens[0].device)
        for start in range(0, self.vocab, self.rows):
            count = min(self.rows, self.vocab - start)
            rows = weight[:count]
            rows.copy_(self.reader.read_rows(self.source, start, count, raw))
            for hidden, out in zip(hiddens, logits, strict=True):
                out[..., start: start + count] = hidden @ rows.T
        return logits


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, module in model.named_modules():
        if module is old:
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attribute, new)


def stream_vocabulary(model: nn.Module, weights: Float32Weights, device: torch.device) -> None:
    """Replace ``model``'s plain input embedding and bias-free output head by modules that read
    the checkpoint a few rows at a time (``RowsFromCheckpoint``, ``HeadByVocabularyChunk``).

    The model is consumed: it runs, then is thrown away, so nothing puts the modules back."""
    names = {id(module): name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is nn.Embedding and embedding.max_norm is None and id(embedding) in names:
        source = weights.sources.get(f"{names[id(embedding)]}.weight")
        if source is not None:
            _replace(model, embedding, RowsFromCheckpoint(weights.reader, source, device))
    if type(head) is nn.Linear and head.bias is None and id(head) in names:
        source = weights.sources.get(f"{names[id(head)]}.weight")
        if source is not None and len(weights.reader.tensors[source].shape) == 2:
            key = None if weights.shared is None else weights.shared_key(source)
            _replace(model, head, HeadByVocabularyChunk(weights.reader, source, pass_key=key))


class Unsupported(Exception):
    """This model cannot be verified layer by layer (the caller falls back to the whole model)."""


@contextmanager
def dispatched(model: nn.Module, checkpoint: Path, blocks_path: str, device: torch.device,
               shared: SharedReads | None = None, shared_key: Callable[[str], Hashable] = str) -> Iterator[nn.Module]:
    """``model`` with accelerate hooks that load each unit's weights from ``checkpoint`` when it
    runs (onto ``device``) and drop them when it is done; with ``shared``, a weight another
    dispatched model also reads is read once for both (``lockstep``): weights are shared under
    ``shared_key(name in the checkpoint)``, so two checkpoints can share a tensor they both hold."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_module

    map_large_allocations()
    release_memory(collect=False)
    with CheckpointReader(checkpoint) as reader:
        weights = Float32Weights(model, reader, shared, shared_key)
        stream_vocabulary(model, weights, device)
        load_by_row_blocks(model, weights, blocks_path)
        with _quiet():
            dispatch_model(model, device_map=device_map_for(model, blocks_path), main_device=str(device),
                           state_dict=weights, offload_index={}, offload_buffers=False)
        try:
            yield model
        finally:
            remove_hook_from_module(model, recurse=True)
            release_memory(collect=False)


def unsupported_reason(architecture: Architecture, original_dir: Path) -> str | None:
    """Why the original cannot be verified layer by layer, or None when it can."""
    if architecture.probe != "causal_lm":
        return f"layer-by-layer verification covers causal LMs; this is a {architecture.probe} model"
    model = original_model(original_dir, architecture)
    found = find_blocks(model, architecture.blocks)
    if found is None:
        return "no list of residual blocks found in the model"
    try:
        device_map_for(model, found[0])
    except Unsupported as error:
        return str(error)
    return None
