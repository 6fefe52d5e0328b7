"""Loading converted checkpoints as RMSNorm models, and converting models already in memory."""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.architectures import ARCHITECTURES, architecture_for
from normswap.checkpoint import validation
from normswap.checkpoint.source import StateDictReader, read_config, resolve_source
from normswap.convert import card
from normswap.dtypes import dtype_name
from normswap.errors import NormswapError
from normswap.modeling import build, registry, remote


def _original_type(config: dict) -> str:
    return (config.get("normswap") or {}).get("original_model_type", config.get("model_type"))


def load(path: str | Path, **from_pretrained_kwargs) -> nn.Module:
    """A converted checkpoint as an RMSNorm model whose norms use normswap's kernels.

    Keyword arguments go to ``from_pretrained`` (``dtype``, ``device_map``, ...).
    """
    registry.register_auto_classes()
    path = resolve_source(path)
    config = read_config(path)
    block = config.get("normswap")
    if block is None:
        raise NormswapError(f"{path} is not a normswap checkpoint; convert it first with `normswap convert`")
    validation.check_provenance(block, path)
    validation.check_structure(path, config)
    architecture = architecture_for({**config, "model_type": _original_type(config)})
    base = build.model_class(config, architecture.auto_class)
    cls = registry.kernel_class(base, own_type=not block.get("stock_loadable", True))
    return build.load_pretrained(cls, path, **from_pretrained_kwargs)


def load_model(src: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
               **from_pretrained_kwargs) -> tuple[nn.Module, Any]:
    """Any checkpoint and its tokenizer (or None): converted ones in RMSNorm form via ``load``."""
    from normswap.runtime.reference import load_tokenizer

    registry.register_auto_classes()
    path = resolve_source(src, trust_remote_code=trust_remote_code)
    config = read_config(path)
    if "normswap" not in config:
        validation.check_structure(path, config)
    if "normswap" in config:
        model = load(path, dtype=dtype, **from_pretrained_kwargs)
    else:
        model_type = config.get("model_type")
        auto_class = ARCHITECTURES[model_type].auto_class if model_type in ARCHITECTURES else "AutoModelForCausalLM"
        cls = build.model_class(config, auto_class)
        try:
            model = build.load_pretrained(cls, path, dtype=dtype, trust_remote_code=trust_remote_code,
                                          **from_pretrained_kwargs)
        except (OSError, ValueError) as error:
            raise NormswapError(f"cannot load {src}: {str(error).splitlines()[0]}") from None
    return model, load_tokenizer(path)


def convert_model(model: nn.Module, *, fold_gains: bool = False, method: str = "exact") -> nn.Module:
    """Convert a model already in memory; returns a new model in RMSNorm form (plain torch norms).

    The same plan and tensor math as ``convert_checkpoint``, without files. Call
    ``normswap.patch`` on the result to use the fused kernels. Its ``save_pretrained(folder)``
    (or ``normswap.save(model, folder)``) writes what ``normswap convert`` writes for the same
    weights: the same tensors, config.json with ``auto_map`` and the provenance block,
    ``modeling_normswap.py`` and the model card.
    """
    from normswap.convert import fold
    from normswap.convert.pipeline import main_dtype, plan_conversion

    # config.json as save_pretrained would write it, which is what convert reads
    config = {**model.config.to_diff_dict(), "architectures": [type(model).__name__]}
    reader = StateDictReader({name: tensor.detach() for name, tensor in model.state_dict().items()})
    architecture, plan, _ = plan_conversion(Path("<memory>"), config, reader, method=method,
                                            fold_gains=fold_gains, dtype=None)
    new_config = copy.deepcopy(model.config)
    if plan.untied:
        setattr(new_config, architecture.tie_flag, False)
    new_config.normswap = {"structure": plan.structure.to_json(), "original_model_type": plan.model_type,
                           "stock_loadable": plan.stock_loadable}
    # clone: untouched tensors must not alias the original model's parameters
    state = {name: fold.compute_tensor(tensor, reader.get).clone() for name, tensor in plan.tensors.items()}
    device = next(model.parameters()).device
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = _saving_class(type(model))(new_config)
    converted.load_state_dict(state, strict=False, assign=True)
    _materialise_buffers(converted, model)
    if getattr(model, "generation_config", None) is not None:
        converted.generation_config = copy.deepcopy(model.generation_config)
    options = {"method": method, "fold_gains": fold_gains, "dtype": dtype_name(main_dtype(plan))}
    source = getattr(model, "name_or_path", "") or "an in-memory model"
    provenance = card.provenance_block(source, plan, options, architecture.auto_class)
    converted._normswap_output = (card.converted_config(config, plan, model, architecture, provenance), plan)
    return converted.to(device).eval()


def save(model: nn.Module, folder: str | Path, *, overwrite: bool = False) -> None:
    """Write a ``convert_model`` result to ``folder`` as ``normswap convert`` writes a conversion
    (no verification figures: there is no original checkpoint to run).

    ``folder`` is claimed and installed like ``convert --out``: a non-empty folder is replaced only
    with ``overwrite`` and only when normswap wrote it.
    """
    from normswap.checkpoint import output
    from normswap.convert.install import install

    saved = getattr(model, "_normswap_output", None)
    if saved is None:
        raise NormswapError("normswap.save takes a model returned by normswap.convert_model")
    config_json, plan = saved
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    reader = StateDictReader({name: state[name] for name in plan.tensors})
    stored = replace(plan, tensors={name: replace(tensor, source=name, steps=[]) for name, tensor in plan.tensors.items()})
    out = output.absolute(folder)
    source = Path(str(getattr(model.config, "_name_or_path", "") or "")).expanduser()
    inputs = [source.resolve()] if str(source) and source.is_dir() else []  # never write into the original
    install(out, inputs, stored, reader, None, copy.deepcopy(config_json["normswap"]),
            config_json=lambda block: {**config_json, "normswap": block}, verifier=None, must_pass=False,
            overwrite=overwrite, quiet=True, verify_options={}, extra_files=lambda tmp: _save_generation(model, tmp))


def _save_generation(model: nn.Module, folder: Path) -> None:
    """generation_config.json, as save_pretrained writes it for a model that generates."""
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


def _saving_class(base: type) -> type:
    """The RMSNorm class of ``base`` whose ``save_pretrained`` is ``normswap.save``."""
    rms = remote.rms_class(base)

    def save_pretrained(self, save_directory: str | Path, *args, **kwargs) -> None:
        save(self, save_directory, overwrite=True)

    return type(rms.__name__, (rms,), {"save_pretrained": save_pretrained, "__module__": __name__})


def _materialise_buffers(converted: nn.Module, original: nn.Module) -> None:
    """Copy non-persistent buffers (rotary tables, masks) that a state dict does not carry."""
    original_buffers = dict(original.named_buffers())
    for name, buffer in list(converted.named_buffers()):
        if buffer.is_meta:
            parent_name, _, leaf = name.rpartition(".")
            parent = converted.get_submodule(parent_name) if parent_name else converted
            source = original_buffers.get(name)
            if source is None:
                raise NormswapError(f"cannot materialise buffer {name} of the converted model")
            parent.register_buffer(leaf, source.clone(), persistent=False)
    for name, parameter in converted.named_parameters():
        if parameter.is_meta:
            raise NormswapError(f"the converted model has no value for {name}")


def convert_checkpoint(src: str | Path, out: str | Path, **options: Any) -> dict:
    """``normswap.convert.pipeline.convert_checkpoint`` (its options), verified by
    ``normswap.verify.checkpoint.verify_checkpoint`` unless ``verification="none"``."""
    from normswap.convert.pipeline import convert_checkpoint as convert
    from normswap.verify.checkpoint import verify_checkpoint

    return convert(src, out, verifier=verify_checkpoint, **options)


def rotate_checkpoint(src: str | Path, out: str | Path, **options: Any) -> dict:
    """``normswap.rotate.pipeline.rotate_checkpoint`` (its options), verified by
    ``normswap.verify.checkpoint.verify_rotated`` unless ``verification="none"``."""
    from normswap.rotate.pipeline import rotate_checkpoint as rotate
    from normswap.verify.checkpoint import verify_rotated

    return rotate(src, out, verifier=verify_rotated, **options)
