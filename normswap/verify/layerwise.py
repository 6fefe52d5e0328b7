"""Layer-by-layer verification within bounded memory.

A model too large to hold twice is compared block by block. The original and the converted model
are each built on the meta device (accelerate's ``init_empty_weights``) and dispatched with
accelerate's ``dispatch_model``: every residual block, and every module outside the block list,
is one unit of the ``device_map``, offloaded, with the checkpoint itself as the offload store
(``Float32Weights``: tensors read from the shards on demand; nothing is copied to an offload
folder). accelerate's hooks then load a unit's weights just before it runs and drop them right
after, so memory holds one block (or the embedding, or the head) at a time. With a GPU present
the execution device is the GPU and each block's weights go there; without one, the CPU.

The original runs once on the probe; forward hooks record the residual stream h entering and
leaving every block, and the logits. The converted model carries the centred stream
C·h = h - mean(h)·1 exactly, so after every block its stream is compared with C·h. It runs on a
doubled batch:

* the first half runs free: max |C·h_i - h'_i| is the error accumulated up to block i, and its
  logits give the usual figures (max |Δlogit|, KL, top-1 agreement, perplexity);
* the second half is teacher-forced: a pre-hook replaces its input to block i by C·h_{i-1}, the
  original's centred input, so its output measures block i's own error. The worst layer is the
  block whose own error is largest relative to the stream's size there: a broken block stands out
  even when later blocks amplify the damage it did.
"""

from __future__ import annotations

import gc
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn

from normswap.architectures import Architecture
from normswap.convert.plan import canonical_names
from normswap.convert.source import CheckpointReader, read_config
from normswap.errors import NormswapError
from normswap.modeling import build
from normswap.threads import on_idle_cores
from normswap.verify import compare as verify

# Above this many bytes of float32 weights, automatic verification goes layer by layer
# (a whole-model comparison holds one float32 copy of the model).
LAYERWISE_ABOVE_BYTES = 1 << 30


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


# ---------------------------------------------------------------------------------------------
# Models on meta, dispatched onto the checkpoint's files


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


def empty_model(cls: type, config) -> nn.Module:
    """``cls`` built with its parameters on meta (buffers stay real), in float32, eval mode."""
    from accelerate import init_empty_weights

    with _quiet(), init_empty_weights():
        model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
    return _float32_tied(model)


def original_model(path: Path, architecture: Architecture) -> nn.Module:
    """The original checkpoint's model class, empty."""
    config = read_config(path)
    return empty_model(build.model_class(config, architecture.auto_class), build.config_object(config))


def converted_model(path: Path, architecture: Architecture, how: str) -> nn.Module:
    """The converted checkpoint's model, empty: the stock class (``stock``), normswap's RMSNorm
    class (``rmsnorm``), or the checkpoint's own code (``remote``, runs it)."""
    if how == "stock":
        return empty_model(build.model_class(read_config(path), architecture.auto_class),
                           transformers.AutoConfig.from_pretrained(path))
    if how == "rmsnorm":
        from normswap.verify.checkpoint import rmsnorm_class

        cls = rmsnorm_class(path, architecture)
        with _quiet():
            config = cls.config_class.from_pretrained(path)
        return empty_model(cls, config)
    from accelerate import init_empty_weights

    with _quiet():
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)
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

    def __init__(self, model: nn.Module, reader: CheckpointReader) -> None:
        from accelerate.utils import find_tied_parameters

        self.reader = reader
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

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.sources[name]
        dtype = self.reader.tensors[source].dtype
        return self.reader.read_as(source, torch.float32 if dtype.is_floating_point else dtype)

    def __contains__(self, name: object) -> bool:
        # Mapping's default reads the tensor to answer; accelerate asks before every read.
        return name in self.sources

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


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
    """One ``device_map`` unit per block and per module outside the block list, all on ``device``.

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
                units.update({f"{full}.{index}": device for index in range(len(child))})
            elif blocks_path.startswith(full + "."):
                visit(child, full)
            else:
                units[full] = device

    visit(model, "")
    return units


class Unsupported(Exception):
    """This model cannot be verified layer by layer (the caller falls back to the whole model)."""


@contextmanager
def dispatched(model: nn.Module, checkpoint: Path, blocks_path: str, device: torch.device) -> Iterator[nn.Module]:
    """``model`` with accelerate hooks that load each unit's weights from ``checkpoint`` when it
    runs (onto ``device``) and drop them when it is done."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_module

    map_large_allocations()
    release_memory()
    with CheckpointReader(checkpoint) as reader:
        weights = Float32Weights(model, reader)
        with _quiet():
            dispatch_model(model, device_map=device_map_for(model, blocks_path), main_device=str(device),
                           state_dict=weights, offload_index={}, offload_buffers=False)
        try:
            yield model
        finally:
            remove_hook_from_module(model, recurse=True)
            release_memory()


def release_memory(collect: bool = True) -> None:
    """Hand freed heap memory back to the system (glibc keeps it otherwise, and per-block loads
    fragment it: measured +22 MB of RSS per GPT-2-XL block without this). ``collect`` also runs
    the cycle collector first, which takes about a second with transformers loaded: worth it
    between models, not after every block, whose weights are freed by reference counting."""
    if collect:
        gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def map_large_allocations(threshold: int = 4 << 20) -> None:
    """Have glibc serve allocations above ``threshold`` with their own mappings, returned to the
    system when freed. By default glibc raises that threshold (up to 32 MB) after each large free,
    after which block-sized weights come from the heap and fragment it; loading one block after
    another then ratchets the RSS up. (Process-wide; glibc only.)"""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(-3, threshold)  # M_MMAP_THRESHOLD


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


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


# ---------------------------------------------------------------------------------------------
# Tracing


def _stream_in(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    raise NormswapError("a block was called without its hidden states as first argument")


def _with_stream(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _stream_out(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _centred(x: torch.Tensor) -> torch.Tensor:
    """C·x in float64: x minus its mean over the hidden (last) dimension."""
    x = x.double()
    return x - x.mean(-1, keepdim=True)


@dataclass
class Trace:
    """The original's residual stream entering each block and leaving the last (CPU, float32),
    and its float32 logits.

    A block's output is kept apart only when it is not the next block's input (it is, in every
    sequential stack), so the stream is stored once per block.
    """

    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None

    def output(self, index: int) -> torch.Tensor:
        """The stream leaving block ``index``."""
        return self.outputs[index] if index in self.outputs else self.inputs[index + 1]


@contextmanager
def _hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def trace_original(model: nn.Module, blocks: nn.ModuleList, inputs: dict, step=None) -> Trace:
    """Run the original on ``inputs``, recording the stream around every block."""
    trace = Trace()
    pending: list[torch.Tensor] = []  # the last block output, until the next block's input is seen
    done = [0]

    def record_in(module, args, kwargs):
        stream = _stream_in(args, kwargs).detach().float().cpu()
        if pending and not torch.equal(pending[0], stream):
            trace.outputs[len(trace.inputs) - 1] = pending[0]
        pending.clear()
        trace.inputs.append(stream)

    def record_out(module, args, output):
        pending.append(_stream_out(output).detach().float().cpu())
        done[0] += 1
        if step is not None:
            step()

    handles = [block.register_forward_pre_hook(record_in, with_kwargs=True) for block in blocks]
    handles += [block.register_forward_hook(record_out) for block in blocks]
    with _hooks(handles):
        trace.logits = model(**inputs, use_cache=False).logits.float().cpu()
    if done[0] != len(blocks) or len(trace.inputs) != len(blocks):
        raise NormswapError(f"{done[0]} of {len(blocks)} blocks ran once; cannot compare layer by layer")
    trace.outputs[len(blocks) - 1] = pending[0]
    return trace


@torch.no_grad()
def trace_converted(model: nn.Module, blocks: nn.ModuleList, inputs: dict, original: Trace,
                    step=None, stream_map=_centred) -> tuple[list[dict], torch.Tensor]:
    """Run the converted model free and teacher-forced (a doubled batch); per-block figures and logits.

    ``stream_map`` turns the original's stream into the one the converted model carries: C·h
    (default), or C·h·Q for a checkpoint whose residual basis was rotated by Q.
    """
    batch = next(iter(inputs.values())).shape[0]
    doubled = {name: torch.cat([value, value]) for name, value in inputs.items()}
    layers: list[dict] = []

    def force(index: int):
        def hook(module, args, kwargs):
            hidden = _stream_in(args, kwargs)
            forced = stream_map(original.inputs[index]).to(hidden.device, hidden.dtype)
            return _with_stream(args, kwargs, torch.cat([hidden[:batch], forced]))

        return hook

    def compare(index: int):
        def hook(module, args, output):
            out = _stream_out(output).double().cpu()
            reference = stream_map(original.output(index))
            layers.append({
                "layer": index,
                "max_abs_diff": float((out[:batch] - reference).abs().max()),
                "block_max_abs_diff": float((out[batch:] - reference).abs().max()),
                "max_abs_reference": float(reference.abs().max()),
            })
            if step is not None:
                step()

        return hook

    handles = [block.register_forward_pre_hook(force(i), with_kwargs=True) for i, block in enumerate(blocks)]
    handles += [block.register_forward_hook(compare(i)) for i, block in enumerate(blocks)]
    with _hooks(handles):
        logits = model(**doubled, use_cache=False).logits[:batch].float().cpu()
    return layers, logits


def compare_by_sequence(reference: torch.Tensor, candidate: torch.Tensor, labels: torch.Tensor | None) -> dict:
    """``verify.compare_outputs`` over the logits of one probe sequence at a time, merged.

    A vocabulary-wide float64 comparison of the whole batch holds several [batch, n, vocab]
    arrays at once; per sequence it holds one sequence's. Sequences have equal length, so the
    merge is exact: maxima are maxima, means (KL, top-1 agreement) are means of the per-sequence
    means, and perplexities (exp of a mean NLL) are geometric means.
    """
    rows = []
    for index in range(reference.shape[0]):
        rows.append(verify.compare_outputs(
            reference[index: index + 1].double(), candidate[index: index + 1].double(), distribution=True,
            labels=None if labels is None else labels[index: index + 1],
        ))
    merged = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key.startswith("max_"):
            merged[key] = max(values)
        elif key.startswith("perplexity_"):
            merged[key] = math.exp(sum(math.log(value) for value in values) / len(values))
        else:
            merged[key] = sum(values) / len(values)
    return merged


def worst_layer(layers: list[dict]) -> dict:
    """The block with the largest own error relative to the stream's size there."""
    def relative(layer: dict) -> float:
        return layer["block_max_abs_diff"] / max(layer["max_abs_reference"], 1e-30)

    worst = max(layers, key=relative)
    return {"layer": worst["layer"], "block_max_abs_diff": worst["block_max_abs_diff"], "relative": relative(worst)}


# ---------------------------------------------------------------------------------------------


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="block", desc="verifying layer by layer", delay=1.0, leave=False, disable=quiet)


@on_idle_cores
def compare_layerwise(original_dir: Path, converted_dir: Path, architecture: Architecture, *,
                      stock_loadable: bool, quiet: bool = True,
                      rms_how: str = "rmsnorm", stream_map=_centred) -> tuple[verify.Probe, dict[str, dict]]:
    """The probe and, per loader run, the logit figures plus per-block figures and the worst layer.

    The stock class runs only when ``stock_loadable`` (the caller records whether stock
    transformers refuses the others). The RMSNorm model is built as ``rms_how`` says (see
    ``converted_model``). Raises ``Unsupported`` when the model cannot be run this way.
    """
    device = execution_device()
    original = original_model(original_dir, architecture)
    found = find_blocks(original, architecture.blocks)
    if found is None:
        raise Unsupported("no list of residual blocks found in the model")
    blocks_path, blocks = found
    probe = verify.PROBES[architecture.probe](original.config, verify.load_tokenizer(original_dir))
    inputs = {name: value.to(device) for name, value in probe.inputs.items()}
    hows = ["stock", "remote"] if stock_loadable else ["remote"]
    bar = _progress(len(blocks) * (1 + len(hows)), quiet)

    def step() -> None:
        bar.update()
        release_memory(collect=False)
    try:
        with dispatched(original, original_dir, blocks_path, device):
            trace = trace_original(original, blocks, inputs, step)
        del original
        loaders: dict[str, dict] = {}
        labels = probe.inputs.get("input_ids")
        for how in hows:
            model = converted_model(converted_dir, architecture, how if how == "stock" else rms_how)
            if how == "remote" and any(isinstance(module, nn.LayerNorm) for module in model.modules()):
                raise NormswapError("the RMSNorm model still has nn.LayerNorm modules")
            converted_blocks = model.get_submodule(blocks_path)
            with dispatched(model, converted_dir, blocks_path, device):
                layers, logits = trace_converted(model, converted_blocks, inputs, trace, step, stream_map)
            del model
            release_memory()
            figures = compare_by_sequence(trace.logits, logits, labels)
            del logits
            figures["worst_layer"] = worst_layer(layers)
            figures["layers"] = layers
            loaders["stock" if how == "stock" else "remote_code"] = figures
    finally:
        bar.close()
    return probe, loaders


def describe_mode(result: dict) -> str:
    """One line on how a verification result was obtained, naming the worst layer when per-block."""
    if result.get("mode") != "layerwise":
        return "compared whole models" + (f"; {result['note']}" if result.get("note") else "")
    worst = result["worst_layer"]
    return (f"compared layer by layer; worst block: {worst['layer']} ({worst['loader']} loader, own max |Δ| = "
            f"{worst['block_max_abs_diff']:.3g}, {worst['relative']:.3g} of the stream's max |h|)")
