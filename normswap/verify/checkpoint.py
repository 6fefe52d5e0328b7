"""Verification of a converted checkpoint against its original.

``verify_checkpoint`` loads the original and the conversion the ways a user would (stock
transformers, normswap's own RMSNorm classes, and with consent the checkpoint's own code), runs
both on one probe, and compares the figures from ``compare``; above a size it goes block by block
(``layerwise``).
"""

from __future__ import annotations

import gc
import hashlib
import math
from pathlib import Path

import torch
import transformers
from torch import nn

from normswap import validation
from normswap.architectures import Architecture, architecture_for
from normswap.convert.source import first_non_finite, read_config, resolve_source
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import MODELING_FILE, build, modeling_sha256, remote
from normswap.threads import on_idle_cores
from normswap.verify import compare as verify
from normswap.verify import layerwise as verify_layerwise


def rmsnorm_class(path: Path, architecture: Architecture) -> type:
    """The RMSNorm class for a converted checkpoint, from the modeling code installed with normswap.

    This is the class the checkpoint's ``modeling_normswap.py`` defines (the file is a copy of
    ``normswap.modeling.remote``), taken from normswap itself so that nothing in the checkpoint runs.
    """
    config = read_config(path)
    base = build.model_class(config, architecture.auto_class)
    if base.__name__.startswith("Auto"):
        raise NormswapError(f"{path / 'config.json'}: 'architectures' names no model class this transformers has")
    own_type = str(config.get("model_type", "")).startswith(remote.MODEL_TYPE_PREFIX)
    return remote._lookup((remote.OWN_TYPE_PREFIX if own_type else remote.CLASS_PREFIX) + base.__name__)


def load_converted(path: Path, how: str, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a converted checkpoint with stock transformers (``stock``), normswap's RMSNorm classes
    (``rmsnorm``), or the checkpoint's own ``modeling_normswap.py`` (``remote``, runs its code).

    The stock path uses the class named in ``architectures`` (a ``ViTForImageClassification``
    must not load as the family Auto class's ``ViTModel``); the remote path goes through the
    family's Auto class, whose ``auto_map`` entry names the RMSNorm form of that same class.
    """
    from normswap.loading import register_auto_classes

    register_auto_classes()  # a normswap_<type> config must resolve, as after ``import normswap``
    config = read_config(path)
    block = config.get("normswap") or {}
    architecture = architecture_for({**config, "model_type": block.get("original_model_type", config.get("model_type"))})
    if how == "stock":
        return build.load_pretrained(build.model_class(config, architecture.auto_class), path, dtype=dtype)
    if how == "rmsnorm":
        return build.load_pretrained(rmsnorm_class(path, architecture), path, dtype=dtype)
    if how == "remote":
        auto = getattr(transformers, architecture.auto_class)
        return build.load_pretrained(auto, path, dtype=dtype, trust_remote_code=True)
    raise ValueError(how)


def verify_checkpoint(original: str | Path, converted: str | Path, *, atol: float | None = None,
                      rtol: float | None = None, layerwise: bool | None = None, quiet: bool = True,
                      trust_remote_code: bool = False) -> dict:
    """Run ``original`` and ``converted`` on the same probe; figures per loader and a verdict.

    ``layerwise``: True compares block by block within bounded memory (``verify_layerwise``),
    False loads whole models, None (default) goes layer by layer above
    ``verify_layerwise.LAYERWISE_ABOVE_BYTES`` of float32 weights. Families that cannot be run
    block by block fall back to whole models, with a note in the result.

    The ``remote_code`` figures are those of the RMSNorm class that ``modeling_normswap.py``
    defines. Its code is normswap's own (the checkpoint's file must be byte for byte the one
    normswap wrote, by its recorded sha256, or verification fails); with ``trust_remote_code``
    the checkpoint's file itself is imported and run instead.
    """
    from normswap.loading import register_auto_classes

    register_auto_classes()  # the converted model's normswap_<type> config must resolve
    original_dir = resolve_source(original)
    converted_dir = Path(converted).expanduser()
    if not (converted_dir / "config.json").is_file():
        raise NormswapError(f"{converted} is not a checkpoint folder (it has no config.json)")
    original_config, converted_config_ = read_config(original_dir), read_config(converted_dir)
    block = converted_config_.get("normswap")
    if "normswap" in original_config:
        swapped = " (the arguments look swapped)" if block is None else ""
        raise NormswapError(f"{original_dir} is a converted checkpoint; verify takes the original first: "
                            f"normswap verify ORIGINAL CONVERTED{swapped}")
    if block is None:
        raise NormswapError(f"{converted_dir} is not a normswap checkpoint (its config.json has no normswap block)")
    validation.check_provenance(block, converted_dir)
    check_modeling_file(block, converted_dir)
    for path, config in ((original_dir, original_config), (converted_dir, converted_config_)):
        validation.check_structure(path, config)
    architecture = architecture_for(original_config)
    if block.get("original_model_type", original_config.get("model_type")) != original_config.get("model_type"):
        raise NormswapError(f"{converted_dir} was converted from a {block['original_model_type']} model, "
                            f"but {original_dir} is a {original_config.get('model_type')} model")
    validation.check_same_shape(original_dir, original_config, converted_dir, converted_config_)
    if "rotation" in block:  # its stream is C·h·Q, not C·h: compared by normswap.rotation
        from normswap.verify.rotated import verify_rotated

        return verify_rotated(original_dir, converted_dir, atol=atol, rtol=rtol, layerwise=layerwise, quiet=quiet,
                              trust_remote_code=trust_remote_code)
    method = block.get("options", {}).get("method", "exact")
    checkpoint_dtype = parse_dtype(block.get("options", {}).get("dtype")) or torch.float32
    default_atol, default_rtol = verify.default_tolerance(checkpoint_dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    rms_how = "remote" if trust_remote_code else "rmsnorm"

    mode, note = _verification_mode(original_dir, architecture, layerwise)
    probe = None
    if mode == "layerwise":
        try:
            probe, loaders = verify_layerwise.compare_layerwise(
                original_dir, converted_dir, architecture, stock_loadable=block.get("stock_loadable", True),
                quiet=quiet, rms_how=rms_how,
            )
        except verify_layerwise.Unsupported as error:
            mode, note = "full", f"layer by layer unavailable ({error}); compared whole models"
        else:
            for figures in loaders.values():
                figures["passed"] = verify.within_tolerance(figures, atol, rtol)
            if not block.get("stock_loadable", True):
                loaders = {"stock": {"refused": _stock_refuses(converted_dir, architecture)}, **loaders}
    if probe is None:
        probe, loaders = _compare_whole(original_dir, converted_dir, original_config, architecture, block, atol, rtol,
                                        rms_how)
    compared = [figures for figures in loaders.values() if "max_abs_diff" in figures]
    if not all(math.isfinite(figures["max_abs_diff"]) and math.isfinite(figures["max_abs_reference"])
               for figures in compared):
        _refuse_non_finite(original_dir, converted_dir)
    limit = atol + rtol * max(figures["max_abs_reference"] for figures in compared)
    passed = all(figures["passed"] for figures in compared) and all(
        figures.get("refused", True) for figures in loaders.values()
    )
    return {
        "probe": probe.kind,
        "probe_shape": list(next(iter(probe.inputs.values())).shape),
        "compute_dtype": "float32",
        "method": method,
        "tolerance": {"atol": atol, "rtol": rtol, "limit": limit},
        "loaders": loaders,
        "passed": passed,
        "mode": mode,
        **({"note": note} if note else {}),
        **({"worst_layer": _worst_layer(loaders)} if mode == "layerwise" else {}),
    }


def check_modeling_file(block: dict, path: Path) -> None:
    """Fail verification unless ``modeling_normswap.py`` is byte for byte the file normswap wrote."""
    file = path / MODELING_FILE
    if not file.is_file():
        raise VerificationError(f"{path} has no {MODELING_FILE}; it is not a complete normswap checkpoint")
    expected = block.get("modeling_sha256") or modeling_sha256()
    actual = hashlib.sha256(file.read_bytes()).hexdigest()
    if actual != expected:
        raise VerificationError(
            f"{file} is not the file normswap wrote (sha256 {actual[:16]}..., expected {expected[:16]}...); "
            "it was changed after conversion"
        )


def _refuse_non_finite(original_dir: Path, converted_dir: Path) -> None:
    """The outputs are NaN or infinite: name the weight responsible, in one line."""
    for path, role in ((original_dir, "original"), (converted_dir, "converted")):
        name = first_non_finite(path)
        if name is not None:
            raise NormswapError(f"the {role} checkpoint {path} has NaN or infinite values in tensor {name}; "
                                "its outputs cannot be compared")
    raise NormswapError("the models' outputs are NaN or infinite on the probe although every weight is finite")


def _worst_layer(loaders: dict[str, dict]) -> dict:
    """The worst block over the loaders compared layer by layer, with the loader named."""
    ranked = [(figures["worst_layer"]["relative"], name) for name, figures in loaders.items() if "worst_layer" in figures]
    _, name = max(ranked)
    return {"loader": name, **loaders[name]["worst_layer"]}


def _verification_mode(original_dir: Path, architecture: Architecture, layerwise: bool | None) -> tuple[str, str | None]:
    """``layerwise`` when asked for, or (``layerwise=None``) when the model is too big to hold twice."""
    if layerwise is False:
        return "full", None
    if layerwise is None and not verify_layerwise.wants_layerwise(original_dir):
        return "full", None
    reason = verify_layerwise.unsupported_reason(architecture, original_dir)
    if reason is not None:
        return "full", f"layer by layer unavailable ({reason}); compared whole models"
    return "layerwise", None


@on_idle_cores
def _compare_whole(original_dir: Path, converted_dir: Path, original_config: dict, architecture: Architecture,
                   block: dict, atol: float, rtol: float, rms_how: str) -> tuple[verify.Probe, dict[str, dict]]:
    """Load each whole model in float32 and compare outputs: the probe and figures per loader."""
    original_model = build.load_pretrained(
        build.model_class(original_config, architecture.auto_class), original_dir, dtype=torch.float32
    )
    probe = verify.PROBES[architecture.probe](original_model.config, verify.load_tokenizer(original_dir))
    reference = verify.model_output(original_model, probe, architecture.probe)
    del original_model
    gc.collect()

    labels = probe.inputs.get("input_ids") if architecture.probe == "causal_lm" else None
    loaders = {}
    for how in ("stock", "remote"):
        if how == "stock" and not block.get("stock_loadable", True):
            loaders["stock"] = {"refused": _stock_refuses(converted_dir, architecture)}
            continue
        model = load_converted(converted_dir, how if how == "stock" else rms_how)
        if how == "remote" and any(isinstance(m, nn.LayerNorm) for m in model.modules()):
            raise NormswapError("the RMSNorm model still has nn.LayerNorm modules")
        candidate = verify.model_output(model, probe, architecture.probe)
        del model
        gc.collect()
        figures = verify.compare_outputs(reference, candidate, distribution=architecture.probe in verify.LOGIT_PROBES,
                                         labels=labels)
        figures["passed"] = verify.within_tolerance(figures, atol, rtol)
        loaders["stock" if how == "stock" else "remote_code"] = figures
    return probe, loaders


def _stock_refuses(path: Path, architecture: Architecture) -> bool:
    """True when stock transformers refuses to load ``path`` without trust_remote_code.

    Trying a load in this process proves nothing: ``import normswap`` registers the
    ``normswap_<type>`` model types with the Auto classes, so the load would succeed. Stock
    transformers on its own knows only its built-in model types, and refuses any other one.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return read_config(path).get("model_type") not in CONFIG_MAPPING_NAMES
