"""Layer-by-layer verification within bounded memory.

A model too large to hold twice is compared block by block: each model runs with its weights
read from the checkpoint one layer at a time (``offload``), so memory holds one layer's weights.

The original runs once on the probe; forward hooks record the residual stream h entering and
leaving every block, and the logits. The converted model carries the centred stream
C·h = h - mean(h)·1 exactly, so after every block its stream is compared with C·h. Its stock and
RMSNorm forms run in lockstep on shared weight reads (``lockstep``), each of them:

* free: max |C·h_i - h'_i| is the error accumulated up to block i, and its logits give the usual
  figures (max |Δlogit|, KL, top-1 agreement, perplexity) on which the verdict rests;
* when it fails the tolerance, once more on a doubled batch whose second half is teacher-forced:
  a pre-hook replaces its input to block i by C·h_{i-1}, the original's centred input, so its
  output measures block i's own error. The worst layer is the block whose own error is largest
  relative to the stream's size there: a broken block stands out even when later blocks amplify
  the damage it did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from normswap.architectures import Architecture
from normswap.checkpoint.source import read_config
from normswap.errors import NormswapError
from normswap.memory import BufferPool, release_memory
from normswap.modeling import build
from normswap.runtime.loaders import checked_form, loader_runs
from normswap.runtime.lockstep import SharedReads, run_in_lockstep
from normswap.runtime.offload import (
    Unsupported,
    block_units,
    converted_model,
    dispatched,
    execution_device,
    find_blocks,
    original_model,
)
from normswap.threads import on_idle_cores
from normswap.verify.compare import compare_by_sequence
from normswap.verify.comparison import Comparison, StreamMap, centred64
from normswap.verify.probes import Probe, build_probe


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
def trace_original(model: nn.Module, blocks: nn.ModuleList, inputs: dict,
                   step: Callable[[], None] | None = None, trace: Trace | None = None) -> Trace:
    """Run the original on ``inputs``, recording the stream around every block (into ``trace``
    when given: a lockstep run reads it while it fills)."""
    trace = Trace() if trace is None else trace
    pending: list[torch.Tensor] = []  # the last block output, until the next block's input is seen
    done = [0]

    def record_in(module, args, kwargs):
        stream = _stream_in(args, kwargs).detach().float().cpu()
        if pending and not torch.equal(pending[0], stream):
            trace.outputs[len(trace.inputs) - 1] = pending[0]
        pending.clear()
        trace.inputs.append(stream)

    def record_out(module, args, output):
        stream = _stream_out(output).detach().float().cpu()
        done[0] += 1
        if done[0] == len(blocks):
            trace.outputs[len(blocks) - 1] = stream
        else:
            pending.append(stream)
        if step is not None:
            step()

    handles = [block.register_forward_pre_hook(record_in, with_kwargs=True) for block in blocks]
    handles += [block.register_forward_hook(record_out) for block in blocks]
    with _hooks(handles):
        trace.logits = model(**inputs, use_cache=False).logits.float().cpu()
    if done[0] != len(blocks) or len(trace.inputs) != len(blocks):
        raise NormswapError(f"{done[0]} of {len(blocks)} blocks ran once; cannot compare layer by layer")
    return trace


@torch.no_grad()
def trace_converted(model: nn.Module, blocks: nn.ModuleList, inputs: dict, original: Trace,
                    step: Callable[[], None] | None = None, stream_map: StreamMap = centred64,
                    teacher_forced: bool = True) -> tuple[list[dict], torch.Tensor]:
    """Run the converted model on ``inputs``: per-block figures and logits.

    It runs free, and with ``teacher_forced`` on a doubled batch whose second half is
    teacher-forced, for each block's own error (``block_max_abs_diff``). ``stream_map`` turns
    the original's stream into the one the converted model carries: C·h (default), or C·h·Q for
    a checkpoint whose residual basis was rotated by Q.
    """
    batch = next(iter(inputs.values())).shape[0]
    run = {name: torch.cat([value, value]) for name, value in inputs.items()} if teacher_forced else inputs
    layers: list[dict] = []

    def force(index: int):
        def hook(module, args, kwargs):
            hidden = _stream_in(args, kwargs)
            forced = stream_map(original.inputs[index]).to(hidden.device, hidden.dtype)
            return _with_stream(args, kwargs, torch.cat([hidden[:batch], forced]))

        return hook

    outputs: dict[int, torch.Tensor] = {}  # compared once the run is over: the original may run beside it

    def record(index: int):
        def hook(module, args, output):
            outputs[index] = _stream_out(output).double().cpu()
            if step is not None:
                step()

        return hook

    handles = [block.register_forward_pre_hook(force(i), with_kwargs=True) for i, block in enumerate(blocks)
               ] if teacher_forced else []
    handles += [block.register_forward_hook(record(i)) for i, block in enumerate(blocks)]
    with _hooks(handles):
        logits = model(**run, use_cache=False).logits[:batch].float().cpu()
    for index in sorted(outputs):
        out, reference = outputs.pop(index), stream_map(original.output(index))
        figures = {"layer": index, "max_abs_diff": float((out[:batch] - reference).abs().max())}
        if teacher_forced:
            figures["block_max_abs_diff"] = float((out[batch:] - reference).abs().max())
        layers.append({**figures, "max_abs_reference": float(reference.abs().max())})
    return layers, logits


def worst_layer(layers: list[dict]) -> dict:
    """The block with the largest own error relative to the stream's size there; without
    teacher-forced figures, the block whose stream error is largest relative to the stream."""
    key = "block_max_abs_diff" if "block_max_abs_diff" in layers[0] else "max_abs_diff"

    def relative(layer: dict) -> float:
        return layer[key] / max(layer["max_abs_reference"], 1e-30)

    worst = max(layers, key=relative)
    return {"layer": worst["layer"], key: worst[key], "relative": relative(worst),
            "teacher_forced": key == "block_max_abs_diff"}


def _progress(total: int, quiet: bool):

    return tqdm(total=total, unit="block", desc="verifying layer by layer", delay=1.0, leave=False, disable=quiet)


Judge = Callable[[dict], bool]  # whether a loader's logit figures are within the tolerance


def sampled_blocks(config: dict, count: int) -> list[int]:
    """The blocks a sampled comparison runs, of ``count``: the first ones, up to the first block
    of each kind that a per-layer list in ``config`` names (``layer_types``, GPT-Neo's
    ``attention_layers``: any list of ``count`` scalars), and at least two.

    Once the weights proof has shown every stored tensor to be the plan's value, what a forward
    pass still has to show is that each loader's class, built from this config, computes the
    original's function from those weights. Blocks of one kind are one function of their
    weights, so a block of every kind shows it; two show the stream handed from block to block.
    The blocks are a prefix, so the model of those blocks is the original's first blocks, each
    with its own index, feeding the final norm and the head (``offload.first_blocks``)."""
    last = min(1, count - 1)
    for value in config.values():
        if isinstance(value, list) and len(value) == count and all(
                isinstance(kind, (str, int, float, bool)) for kind in value):
            firsts: dict = {}
            for index, kind in enumerate(value):
                firsts.setdefault(kind, index)
            last = max(last, *firsts.values())
    return list(range(last + 1))


def probed_tensors(names: Iterable[str], config: dict, blocks_path: str | None) -> list[str]:
    """The tensors of ``names`` (a checkpoint's, in order) that a comparison of the
    ``sampled_blocks`` reads: every tensor outside the blocks (embeddings, final norm, head) and
    those of the blocks it runs. A tensor is a block's when its name holds the last component of
    ``blocks_path`` followed by the block's index (``decoder.layers.3.``); the count of blocks is
    read off the names. None are named without a ``blocks_path``."""
    names = list(names)
    if not blocks_path:
        return []
    leaf = blocks_path.rsplit(".", 1)[-1]
    block_of: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        index = next((int(parts[i + 1]) for i in range(len(parts) - 1)  # ASCII digits a block count can reach
                      if parts[i] == leaf and parts[i + 1].isascii() and parts[i + 1].isdigit()
                      and len(parts[i + 1]) <= 9), None)
        if index is not None:
            block_of[name] = index
    if not block_of:
        return []
    run = set(sampled_blocks(config, max(block_of.values()) + 1))
    return [name for name in names if name not in block_of or block_of[name] in run]


def _block_count(config) -> int | None:
    """The number of blocks a transformers config builds (``num_hidden_layers``), or None."""
    count = getattr(config, "num_hidden_layers", None)
    return count if isinstance(count, int) and count > 0 else None


def _with_blocks(make: Callable[[int | None], nn.Module], blocks_path: str, indices: list[int]) -> nn.Module:
    """``make(len(indices))``, the model of the first blocks, as the original's class built it (a
    converted checkpoint's class is the original's, or normswap's subclass of it); a class that
    builds more blocks is cut to them (``keep_blocks``)."""
    model = make(len(indices))
    found = find_blocks(model, blocks_path)
    if found is None:
        raise Unsupported(f"the converted model has no block list at {blocks_path}")
    if len(found[1]) < len(indices):
        raise Unsupported(f"the converted model builds {len(found[1])} blocks, not the {len(indices)} compared")
    keep_blocks(model, blocks_path, indices)
    return model


def keep_blocks(model: nn.Module, blocks_path: str, indices: list[int]) -> None:
    """Make ``model`` run only the blocks ``indices`` of its list at ``blocks_path``, in order.
    The kept blocks keep their names (``transformer.h.1``), so each reads its own weights."""
    blocks = model.get_submodule(blocks_path)
    if indices == list(range(len(blocks))):
        return
    kept = nn.ModuleList()
    for index in indices:
        kept.add_module(str(index), blocks[index])
    parent, _, attribute = blocks_path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, kept)


@dataclass
class _Converted:
    """What every run of the converted checkpoint needs."""

    path: Path
    architecture: Architecture
    blocks_path: str
    device: torch.device
    inputs: dict
    original: Trace
    step: Callable[[], None]
    stream_map: StreamMap
    config: dict | None = None  # the converted checkpoint's config.json, read once by the caller
    blocks: list[int] | None = None  # the blocks run (``keep_blocks``), all when None

    def run(self, model: nn.Module, teacher_forced: bool) -> tuple[list[dict], torch.Tensor]:
        return trace_converted(model, model.get_submodule(self.blocks_path), self.inputs, self.original, self.step,
                               self.stream_map, teacher_forced)

    def load(self, how: str) -> nn.Module:
        if self.blocks is None:
            return checked_form(how, converted_model(self.path, self.architecture, how, self.config))
        return _with_blocks(lambda layers: checked_form(
            how, converted_model(self.path, self.architecture, how, self.config, layers)), self.blocks_path, self.blocks)


def _one_by_one(converted: _Converted, runs: list[tuple[str, str]], teacher_forced: bool) -> Iterator[tuple]:
    """(label, per-block figures, logits) for each load, one model at a time."""
    for label, how in runs:
        model = converted.load(how)
        with dispatched(model, converted.path, converted.blocks_path, converted.device):
            layers, logits = converted.run(model, teacher_forced)
        del model
        release_memory()
        yield label, layers, logits


def _pool(converted: _Converted) -> BufferPool | None:
    """Memory reused for the weights of block after block, when every block runs: it saves the
    page faults of fresh memory each block, at the cost of keeping it mapped throughout."""
    return BufferPool() if converted.blocks is None else None


def _turns(model: nn.Module, blocks_path: str) -> list[nn.Module]:
    """The units a lockstep run takes turns over: every unit a block is loaded in that holds
    weights (``offload.block_units``: a weight read for several models is kept only until each
    has run that one layer), block after block, then the output head (so that the models'
    vocabulary-wide heads never run at the same time either; heads that read one weight make one
    pass over it instead: ``lockstep.SharedHead``)."""
    units = [model.get_submodule(name) for index, block in enumerate(model.get_submodule(blocks_path))
             for name in block_units(block, f"{blocks_path}.{index}")]
    head = _head(model)
    return [*(unit for unit in units if next(unit.parameters(), None) is not None), *([head] if head is not None else [])]


def _head(model: nn.Module) -> nn.Module | None:
    head = model.get_output_embeddings()
    return head if isinstance(head, nn.Module) else None


def _beside_original(original: nn.Module, original_dir: Path, converted: _Converted, runs: list[tuple[str, str]],
                     identical: Mapping[str, str]) -> list[tuple]:
    """(label, per-block figures, logits) for each load, run free in lockstep with the original,
    whose trace fills ``converted.original`` as it runs. A weight the conversion holds byte for
    byte as the original does (``identical``: converted name -> original name, as the weights
    proof found) is read and converted once for all the models, and an output head that reads
    such a weight makes one pass over it for all of them."""
    models = [converted.load(how) for _, how in runs]
    shared = SharedReads(_pool(converted))

    def original_key(name: str) -> tuple[str, str]:
        return "original", name

    def converted_key(name: str) -> tuple[str, str]:
        return ("original", identical[name]) if name in identical else ("converted", name)

    with ExitStack() as stack:
        stack.enter_context(dispatched(original, original_dir, converted.blocks_path, converted.device, shared,
                                       original_key))
        for model in models:
            stack.enter_context(dispatched(model, converted.path, converted.blocks_path, converted.device, shared,
                                           converted_key))
        blocks = original.get_submodule(converted.blocks_path)
        results = run_in_lockstep(
            [partial(trace_original, original, blocks, converted.inputs, converted.step, converted.original),
             *[partial(converted.run, model, False) for model in models]],
            [_turns(original, converted.blocks_path), *[_turns(model, converted.blocks_path) for model in models]],
            [_head(original), *[_head(model) for model in models]])
        shared.clear()
    del models, results[0]
    # the cycle collector frees the models' module graphs, which matters after every block ran;
    # a few sampled blocks hold little, and with transformers loaded a collection takes a while
    release_memory(collect=converted.blocks is None)
    return [(label, layers, logits) for (label, _), (layers, logits) in zip(runs, results, strict=True)]


def _together(converted: _Converted, runs: list[tuple[str, str]], teacher_forced: bool) -> Iterator[tuple]:
    """(label, per-block figures, logits) for each load, all run in lockstep on shared weight reads."""
    models = [converted.load(how) for _, how in runs]
    shared = SharedReads(_pool(converted))
    with ExitStack() as stack:
        for model in models:
            stack.enter_context(dispatched(model, converted.path, converted.blocks_path, converted.device, shared))
        results = run_in_lockstep([partial(converted.run, model, teacher_forced) for model in models],
                                  [_turns(model, converted.blocks_path) for model in models],
                                  [_head(model) for model in models])
        shared.clear()
    del models
    release_memory()
    for (label, _), (layers, logits) in zip(runs, results, strict=True):
        yield label, layers, logits


@on_idle_cores
def compare_layerwise(comparison: Comparison, *, passes: Judge | None = None, shared_reads: bool = True,
                      identical: Mapping[str, str] | None = None,
                      check: Callable[[], None] | None = None) -> tuple[Probe, dict[str, dict]]:
    """The probe and, per load of the converted checkpoint (``loaders.loader_runs``), the logit
    figures plus per-block figures and the worst layer.

    ``comparison.stream_map`` turns the original's stream into the one the converted model must
    carry. With ``shared_reads`` the loads run in lockstep, each block's weights read and
    converted once for all of them (``lockstep``); the figures are those of separate runs, bit
    for bit. With ``passes`` too, the original runs in the same lockstep, and a tensor the
    conversion holds byte for byte as the original does (``identical``: converted name ->
    original name, as the weights proof found) is read once for every model.

    With ``passes`` (the verdict on a loader's logit figures), the loads run free only: the
    verdict rests on the free run's logits alone, and the teacher-forced half only says which
    block is to blame for a failure. A load that fails ``passes`` runs again, alone, with the
    teacher-forced half, and those are its figures. A load that passes keeps its free run's
    per-block figures (its stream against the original's at every block); its worst layer is
    the block whose stream error is largest relative to the stream. Without ``passes`` every
    load runs teacher-forced too. Raises ``Unsupported`` when the model cannot be run this way.
    ``check`` runs after every block any model runs; what it raises stops every model. Without
    ``comparison.every_block``, the models run the ``sampled_blocks`` only, and the figures name
    the blocks run under ``blocks`` (for a checkpoint whose weights are proven).
    """
    original_dir, converted_dir, architecture = (comparison.reference_dir, comparison.converted_dir,
                                                 comparison.architecture)
    configs, every_block, quiet = comparison.configs, comparison.every_block, comparison.quiet
    stock_loadable, rms_how, stream_map = comparison.stock_loadable, comparison.rms_how, comparison.stream_map
    device, identical = execution_device(), identical or {}
    config = read_config(original_dir) if configs[0] is None else configs[0]
    built_config = build.config_object(config)
    total = _block_count(built_config) if not every_block and architecture.blocks else None
    # to_dict: with the per-layer lists a config computes (GPT-Neo's attention_layers)
    indices = None if total is None else sampled_blocks(built_config.to_dict(), total)
    original = None
    if indices is not None and len(indices) < total:  # build those first blocks only
        original = original_model(original_dir, architecture, config, len(indices))
        found = find_blocks(original, architecture.blocks)
        if found is None or len(found[1]) != len(indices):  # the class builds every block: run them all
            original = None
    if original is None:
        original, indices = original_model(original_dir, architecture, config), None
    found = find_blocks(original, architecture.blocks)
    if found is None:
        raise Unsupported("no list of residual blocks found in the model")
    blocks_path, blocks = found
    if indices is None:
        total, indices = len(blocks), list(range(len(blocks)))
    probe = build_probe(architecture.probe, original.config, original_dir)
    inputs = {name: value.to(device) for name, value in probe.inputs.items()}
    runs = loader_runs(stock_loadable, rms_how)
    bar = _progress(len(blocks) * (1 + len(runs)), quiet)

    def step() -> None:
        bar.update()
        release_memory(collect=False)
        if check is not None:
            check()

    try:
        trace = Trace()
        sampled = len(indices) < total
        converted = _Converted(converted_dir, architecture, blocks_path, device, inputs, trace, step, stream_map,
                               configs[1], indices if sampled else None)
        if shared_reads and passes is not None:
            results = _beside_original(original, original_dir, converted, runs, identical)
        else:
            with dispatched(original, original_dir, blocks_path, device):
                trace_original(original, blocks, inputs, step, trace)
            run_all = _together if shared_reads and len(runs) > 1 else _one_by_one
            results = run_all(converted, runs, teacher_forced=passes is None)
        del original, blocks
        loaders: dict[str, dict] = {}
        for label, layers, logits in results:
            figures = compare_by_sequence(trace.logits, logits, probe.inputs.get("input_ids"))
            if passes is not None and not passes(figures):
                bar.total += len(trace.inputs)
                (_, layers, logits), = _one_by_one(converted, [(label, dict(runs)[label])], teacher_forced=True)
                figures = compare_by_sequence(trace.logits, logits, probe.inputs.get("input_ids"))
            for layer in layers:
                layer["layer"] = indices[layer["layer"]]
            loaders[label] = {**figures, "worst_layer": worst_layer(layers), "layers": layers,
                              **({"blocks": {"run": indices, "of": total}} if sampled else {})}
    finally:
        bar.close()
    return probe, loaders
