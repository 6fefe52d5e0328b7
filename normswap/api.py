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
from normswap.arguments import check_device_map, checked
from normswap.checkpoint import output, validation
from normswap.checkpoint.provenance import Provenance, family_config
from normswap.checkpoint.rotations import DEFAULT_CALIBRATION_TOKENS, DEFAULT_FORM, DEFAULT_METHOD
from normswap.checkpoint.source import StateDictReader, read_config, resolve_source
from normswap.convert import card, fold
from normswap.convert.install import OutputFiles, install, requested
from normswap.convert.pipeline import ConversionOptions, main_dtype, plan_conversion
from normswap.convert.pipeline import convert_checkpoint as convert
from normswap.dtypes import dtype_name, parse_dtype
from normswap.errors import NormswapError, options_named
from normswap.evaluation.calibration import MediaInputs
from normswap.modeling import build, online
from normswap.runtime.checkpoint import Checkpoint
from normswap.runtime.reference import load_tokenizer
from normswap.verify.checkpoint import verify_conversion, verify_rotation
from normswap.verify.proof import WrittenProof

# how messages name the output arguments of convert_checkpoint and rotate_checkpoint
_OUT_ARGUMENTS = {"--out": "out", "--overwrite": "overwrite=True"}


def _check_loading(where: str, kwargs: dict) -> None:
    """``dtype`` and ``device_map`` as ``from_pretrained`` takes them, refused here rather than deep inside."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is not None and dtype != "auto":
        if not isinstance(dtype, (str, torch.dtype)):
            raise TypeError(f"{where}: dtype must be a torch.dtype, a dtype name or 'auto', not {type(dtype).__name__}")
        parse_dtype(dtype)
    check_device_map(where, kwargs.get("device_map"))


@checked
def load(path: str | Path, **from_pretrained_kwargs) -> nn.Module:
    """A converted checkpoint as an RMSNorm model whose norms use normswap's kernels.

    Keyword arguments go to ``from_pretrained`` (``dtype``, ``device_map``, ...).
    """
    from normswap.modeling import registry

    _check_loading("normswap.load", from_pretrained_kwargs)
    registry.register_auto_classes()
    path = resolve_source(path)
    config = read_config(path)
    provenance = Provenance.of(config, path)
    if provenance is None:
        raise NormswapError(f"{path} is not a normswap checkpoint; convert it first with `normswap convert`")
    validation.check_structure(path, config)
    architecture = architecture_for(family_config(config))
    base = build.model_class(config, architecture.auto_class)
    if not provenance.rmsnorm_exact:
        # a commuting rotation of an uncentred stream: only the stock LayerNorm class computes it
        return build.load_pretrained(base, path, **from_pretrained_kwargs)
    online.check_config(config, architecture.auto_class, path)
    cls = registry.kernel_class(base, own_type=not provenance.stock_loadable)
    return build.load_pretrained(cls, path, **from_pretrained_kwargs)


@checked
def load_model(src: str | Path, *, dtype: torch.dtype | str = torch.float32, trust_remote_code: bool = False,
               **from_pretrained_kwargs) -> tuple[nn.Module, Any]:
    """Any checkpoint and its tokenizer (or None): converted ones in RMSNorm form via ``load``."""
    from normswap.modeling import registry

    _check_loading("normswap.load_model", {**from_pretrained_kwargs, "dtype": dtype})
    registry.register_auto_classes()
    path = resolve_source(src, trust_remote_code=trust_remote_code)
    config = read_config(path)
    if "normswap" not in config:
        validation.check_structure(path, config)
    tokenizer = load_tokenizer(path, config)  # checked against the model's vocabulary before the model loads
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
    _refuse_non_finite(model, path)
    return model, tokenizer


def _refuse_non_finite(model: nn.Module, path: Path) -> None:
    """A model with a NaN or infinite weight gives no figure that means anything: name the weight."""
    for name, tensor in model.named_parameters():  # buffers may hold -inf masks on purpose
        if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
            raise NormswapError(f"{path}: weight {name} holds NaN or infinite values; no figure of this model "
                                "would mean anything")


def _check_model(model: nn.Module, method: str) -> None:
    """A transformers model with finite weights, and a known method (see ``convert_model``)."""
    if not callable(getattr(getattr(model, "config", None), "to_diff_dict", None)):
        raise TypeError(f"normswap.convert_model: model must be a transformers model (PreTrainedModel), "
                        f"not {type(model).__name__}")
    if method not in ("exact", "naive"):
        raise NormswapError(f"normswap.convert_model: method must be 'exact' or 'naive', not {method!r:.40}")
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NormswapError(f"normswap.convert_model: {name} holds NaN or inf; a conversion of it would be "
                                "meaningless")


@checked
def convert_model(model: nn.Module, *, fold_gains: bool = False, method: str = "exact") -> nn.Module:
    """Convert a model already in memory; returns a new model in RMSNorm form (plain torch norms).

    The same plan and tensor math as ``convert_checkpoint``, without files. Call
    ``normswap.patch`` on the result to use the fused kernels. Its ``save_pretrained(folder)``
    (or ``normswap.save(model, folder)``) writes what ``normswap convert`` writes for the same
    weights: the same tensors, config.json with ``auto_map`` and the provenance block,
    ``modeling_normswap.py`` and the model card.
    """

    _check_model(model, method)
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
    source = getattr(model, "name_or_path", "") or card.IN_MEMORY
    provenance = card.provenance_block(source, plan, options, architecture.auto_class)
    converted._normswap_output = (card.converted_config(config, plan, model, architecture, provenance), plan)
    return converted.to(device).eval()


@checked
def save(model: nn.Module, folder: str | Path, *, overwrite: bool = False) -> None:
    """Write a ``convert_model`` result to ``folder`` as ``normswap convert`` writes a conversion
    (no verification figures: there is no original checkpoint to run).

    ``folder`` is claimed and installed like ``convert --out``: a non-empty folder is replaced only
    with ``overwrite`` and only when normswap wrote it.
    """

    saved = getattr(model, "_normswap_output", None)
    if saved is None:
        raise NormswapError("normswap.save takes a model returned by normswap.convert_model")
    config_json, plan = saved
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    reader = StateDictReader({name: state[name] for name in plan.tensors})
    stored = replace(plan, tensors={name: replace(tensor, source=name, steps=[]) for name, tensor in plan.tensors.items()})
    out = output.absolute(folder)
    # never write into the folder the model was loaded from; a model built from a config has none
    # (an empty name, which as a path would be the current folder)
    name = str(getattr(model.config, "_name_or_path", "") or "")
    source = Path(name).expanduser()
    inputs = [source.resolve()] if name and source.is_dir() else []
    with options_named({"--out": "folder", "--overwrite": "overwrite=True"}):
        files = OutputFiles(out, inputs, stored, copy.deepcopy(config_json["normswap"]),
                            config_json=lambda block: {**config_json, "normswap": block}, overwrite=overwrite,
                            quiet=True, extra_files=lambda tmp: _save_generation(model, tmp))
        install(files, reader, None)


def _save_generation(model: nn.Module, folder: Path) -> None:
    """generation_config.json, as save_pretrained writes it for a model that generates."""
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)


def _saving_class(base: type) -> type:
    """The RMSNorm class of ``base`` whose ``save_pretrained`` is ``normswap.save``."""
    from normswap.modeling import remote

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


@checked
def convert_checkpoint(
    src: str | Path, out: str | Path, *, fold_gains: bool = False, method: str = "exact",
    dtype: str | torch.dtype | None = None, overwrite: bool = False, trust_remote_code: bool = False,
    atol: float | None = None, rtol: float | None = None, allow_inexact: bool = False, quiet: bool = True,
    verification: str = "auto", revision: str | None = None,
) -> dict:
    """Convert ``src`` to an exact RMSNorm checkpoint at ``out``, verified against ``src`` by
    ``normswap.verify.checkpoint.verify_conversion`` unless ``verification="none"``; the options
    are ``normswap.convert.pipeline.ConversionOptions``' and ``convert.install.Verification``'s. The verifier is chosen here, in the
    public layer, because ``convert`` sits below ``verify`` and never imports it. The options are
    checked, in one line each, before the source is resolved."""

    with options_named(_OUT_ARGUMENTS):
        checks = requested(verification, atol, rtol, quiet)
        options = ConversionOptions(method=method, fold_gains=fold_gains, dtype=dtype, allow_inexact=allow_inexact)
        source = Checkpoint.open(src, trust_remote_code=trust_remote_code, revision=revision)
        return convert(source, out, options, checks, overwrite=overwrite, quiet=quiet, verifier=verify_conversion,
                       prover=WrittenProof)


@checked
def rotate_checkpoint(
    src: str | Path, out: str | Path, *, method: str = DEFAULT_METHOD, seed: int = 0, form: str = DEFAULT_FORM,
    calibration: str | Path | None = None, calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    dtype: str | torch.dtype | None = None, overwrite: bool = False, trust_remote_code: bool = False,
    atol: float | None = None, rtol: float | None = None, verification: str = "auto", quiet: bool = True,
    online_hadamard: bool = False,
) -> dict:
    """Write ``src`` with its residual basis rotated to ``out``, verified against ``src`` by
    ``normswap.verify.checkpoint.verify_rotation`` unless ``verification="none"``; the options are
    ``normswap.rotate.pipeline.RotationOptions``' (method ``hadamard``, ``orthogonal`` or ``pca``;
    form ``commuting``, Q·1 = 1 and the stock model type, or ``free``, the ``normswap_<type>`` form).
    ``calibration`` (pca) is what the model reads: a text file, or for Whisper transcribed audio
    and for ViT images (``normswap.evaluation.calibration``); ``bundled`` names the shipped samples.
    ``online_hadamard`` (``form="free"``): H at every MLP down projection's input, at run time."""
    from normswap.rotate.pipeline import RotationOptions
    from normswap.rotate.pipeline import rotate_checkpoint as rotate

    with options_named(_OUT_ARGUMENTS):
        options = RotationOptions(method=method, seed=seed, form=form, calibration=calibration,
                                  calibration_tokens=calibration_tokens, dtype=dtype, online_hadamard=online_hadamard)
        checks = requested(verification, atol, rtol, quiet)
        source = Checkpoint.open(src, trust_remote_code=trust_remote_code)
        return rotate(source, out, options, checks, overwrite=overwrite, quiet=quiet, verifier=verify_rotation,
                      media=MediaInputs(), prover=WrittenProof)
