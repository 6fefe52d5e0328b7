"""The conversion pipeline: load → plan → fold → write → verify, atomically.

``convert_checkpoint`` writes into a temporary directory beside ``out`` and installs it only after
verification passed (``normswap.output``), so a failed or interrupted conversion leaves nothing.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import shutil
from pathlib import Path

import torch
import transformers
from torch import nn

from normswap import __version__, output, validation, verify, verify_layerwise
from normswap.architectures import IDENTITY, Architecture, architecture_for
from normswap.card import MODEL_CARD
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import build, remote
from normswap.plan import ConversionPlan, build_plan
from normswap.source import CheckpointReader, first_non_finite, read_config, resolve_source
from normswap.threads import on_idle_cores
from normswap.write import copy_side_files, write_json, write_weights

MODELING_FILE = "modeling_normswap.py"
VERIFICATION_MODES = ("auto", "layerwise", "full", "none")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise NormswapError(f"unknown dtype '{name}'; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def plan_conversion(
    source_dir: Path, config: dict, reader: CheckpointReader, *, method: str, fold_gains: bool,
    dtype: torch.dtype | None,
) -> tuple[Architecture, ConversionPlan, nn.Module]:
    """The adapter, the plan, and the family's model built on the meta device."""
    architecture = check_convertible(source_dir, config)
    where = f"{source_dir / 'config.json'}"
    validation.check_layer_count(config, reader.tensors, where)  # before building thousands of layers
    meta = build.meta_model(config, architecture.auto_class)
    plan = build_plan(
        architecture, config, reader.tensors,
        model_keys=set(meta.state_dict().keys()),
        layer_norm_modules=build.layer_norm_modules(meta),
        base_prefix=meta.base_model_prefix,
        method=method, fold_gains=fold_gains, dtype=dtype,
        read_small=reader.get,
        rename=build.checkpoint_renamer(meta),
        module_names=[name for name, _ in meta.named_modules()],
    )
    check_shapes(plan, meta, where)
    return architecture, plan, meta


def check_shapes(plan: ConversionPlan, meta: nn.Module, where: str) -> None:
    """Refuse weights whose shapes are not the ones the config implies for the model class."""
    expected = {name: tuple(value.shape) for name, value in meta.state_dict().items()}
    for name, tensor in plan.tensors.items():
        implied = expected.get(name)
        if implied is not None and implied != tuple(tensor.shape):
            raise NormswapError(f"tensor {tensor.source} has shape {list(tensor.shape)}, but {where} implies "
                                f"{list(implied)}")


def check_convertible(source_dir: Path, config: dict) -> Architecture:
    """The adapter for ``config``, or a NormswapError saying why the checkpoint cannot be converted."""
    if "normswap" in config:
        raise NormswapError(f"{source_dir} was already converted by normswap; convert the original instead")
    validation.check_config(config, f"{source_dir / 'config.json'}")
    return architecture_for(config)


def stock_can_hold(plan: ConversionPlan) -> bool:
    """Whether the stock LayerNorm class computes the converted model exactly.

    It does when every write is centred (LayerNorm's mean removal is then a no-op) and no module
    was removed. A naive swap changes the function, and a baked embedding norm must not be applied
    a second time, so those get their own model type, which stock transformers refuses to load.
    """
    return plan.method == "exact" and not plan.structure.get(IDENTITY)


def converted_config(config: dict, plan: ConversionPlan, meta: nn.Module, architecture: Architecture,
                     provenance: dict) -> dict:
    """config.json of the output: the source's, untied, with auto_map and the provenance block."""
    new = dict(config)
    if plan.untied:
        new[architecture.tie_flag] = False
    dtypes = {tensor.dtype for tensor in plan.tensors.values() if tensor.dtype.is_floating_point}
    if len(dtypes) == 1:
        dtype_name = str(dtypes.pop()).removeprefix("torch.")
        new["dtype"] = dtype_name
        if "torch_dtype" in new:
            new["torch_dtype"] = dtype_name
    model_name = type(meta).__name__
    new["architectures"] = [model_name]
    # the family's Auto class, and every other Auto class that maps this type to this class
    # (AutoModelForImageClassification for a ViTForImageClassification)
    autos = [architecture.auto_class, *build.auto_classes_for(config["model_type"], model_name)]
    if stock_can_hold(plan):
        new["auto_map"] = {auto: f"modeling_normswap.{remote.CLASS_PREFIX}{model_name}" for auto in autos}
    else:
        config_name = type(meta.config).__name__
        new["model_type"] = remote.MODEL_TYPE_PREFIX + config["model_type"]
        new["auto_map"] = {
            "AutoConfig": f"modeling_normswap.{remote.CLASS_PREFIX}{config_name}",
            **{auto: f"modeling_normswap.{remote.OWN_TYPE_PREFIX}{model_name}" for auto in autos},
        }
    new["normswap"] = provenance
    return new


def provenance_block(source: str, plan: ConversionPlan, options: dict, auto_class: str) -> dict:
    return {
        "version": __version__,
        "source": source,
        "options": options,
        "original_model_type": plan.model_type,
        "norms_swapped": [norm.name for norm in plan.norms],
        "norms_folded": [norm.name for norm in plan.norms if norm.folded_gain],
        "writers_centred": len(plan.writers),
        "untied": [head for head, _ in plan.untied],
        "stock_loadable": stock_can_hold(plan),
        "structure": plan.structure,
        "auto_class": auto_class,
        # verify refuses a checkpoint whose modeling file is not the one written here
        "modeling_sha256": modeling_sha256(),
    }


def convert_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    fold_gains: bool = False,
    method: str = "exact",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    allow_inexact: bool = False,
    quiet: bool = True,
    verification: str = "auto",
    revision: str | None = None,
) -> dict:
    """Convert the LayerNorm checkpoint ``src`` into an exact RMSNorm checkpoint at ``out``.

    Returns the provenance block written into ``out/config.json`` (with the verification
    figures). Raises ``NormswapError`` for bad input and ``VerificationError`` when the converted
    model does not match the original; in both cases nothing is left at ``out``.

    Tensors stream from the source shards to the output shards one group at a time, so memory is
    bounded by the largest tensor group, not the model. ``verification`` is ``auto`` (layer by
    layer for models too big to hold twice, else whole models), ``layerwise``, ``full`` or
    ``none``. A failure, a full disk or SIGINT/SIGTERM leaves
    nothing at ``out`` and no temporary directory.
    """
    if verification not in VERIFICATION_MODES:
        raise NormswapError(f"unknown verification '{verification}'; use one of {', '.join(VERIFICATION_MODES)}")
    if method == "naive" and not allow_inexact:
        raise NormswapError("--method naive changes the model's outputs; pass --allow-inexact to accept that")
    out_dtype = parse_dtype(dtype)
    source_dir = resolve_source(src, trust_remote_code=trust_remote_code, revision=revision)
    out = output.absolute(out)
    inputs = source_inputs(source_dir)
    output.check_out(out, inputs, overwrite)
    config = read_config(source_dir)
    check_convertible(source_dir, config)  # before reading any weights
    with CheckpointReader(source_dir) as reader:
        architecture, plan, meta = plan_conversion(
            source_dir, config, reader, method=method, fold_gains=fold_gains, dtype=out_dtype
        )
        checkpoint_dtype = _main_dtype(plan)
        options = {"method": method, "fold_gains": fold_gains, "dtype": str(checkpoint_dtype).removeprefix("torch.")}
        provenance = provenance_block(str(src), plan, options, architecture.auto_class)
        if revision is not None:
            provenance["revision"] = revision
        _check_free_space(out, plan)
        with output.claimed_output(out, inputs=inputs, overwrite=overwrite, kind="checkpoint") as claim:
            tmp = claim.tmp
            progress = None if quiet else _progress_bar(plan)
            write_weights(tmp, plan, reader, progress)
            if progress is not None:
                progress.close()
            reader.close()
            (tmp / MODELING_FILE).write_bytes(modeling_source())
            copy_side_files(source_dir, tmp)
            write_json(tmp / "config.json", converted_config(config, plan, meta, architecture, provenance))
            if verification != "none":
                default_atol, default_rtol = verify.default_tolerance(checkpoint_dtype)
                result = verify_checkpoint(
                    source_dir, tmp,
                    atol=default_atol if atol is None else atol,
                    rtol=default_rtol if rtol is None else rtol,
                    layerwise={"auto": None, "layerwise": True, "full": False}[verification],
                    quiet=quiet,
                )
                provenance["verification"] = result
                write_json(tmp / "config.json", converted_config(config, plan, meta, architecture, provenance))
                if not result["passed"] and method == "exact":
                    raise VerificationError(_failure_line(result))
            (tmp / "README.md").write_text(model_card(provenance))
            claim.install()
    return provenance


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


def modeling_source() -> bytes:
    """The bytes of ``modeling_normswap.py`` as this normswap writes it."""
    return Path(remote.__file__).read_bytes()


def modeling_sha256() -> str:
    return hashlib.sha256(modeling_source()).hexdigest()


def _main_dtype(plan: ConversionPlan) -> torch.dtype:
    """The least precise floating dtype of the output: it sets the verification tolerance (a
    checkpoint mixing float16 and float32 tensors is as exact as its float16 ones)."""
    dtypes = {tensor.dtype for tensor in plan.tensors.values() if tensor.dtype.is_floating_point}
    return max(dtypes, key=lambda dtype: verify.default_tolerance(dtype), default=torch.float32)


def _failure_line(result: dict) -> str:
    worst = max(result["loaders"].items(), key=lambda item: item[1].get("max_abs_diff", 0.0))
    return (
        f"verification failed: {worst[0]} loader max |Δ| = {worst[1]['max_abs_diff']:.3g} exceeds "
        f"tolerance {result['tolerance']['limit']:.3g}; nothing was written"
    )


def _check_free_space(out: Path, plan: ConversionPlan) -> None:
    """Refuse early when the output's filesystem cannot hold the converted weights."""
    needed = sum(tensor.nbytes for tensor in plan.tensors.values())
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # no figure to compare with; a full disk is still reported when writing
    if free < needed:
        raise NormswapError(
            f"not enough disk space beside --out: the converted weights need {_size(needed)}, "
            f"{_size(free)} {'is' if free == 1 else 'are'} free; nothing was written"
        )


def _size(count: int) -> str:
    """A byte count for people: 512 bytes, 3.4 kB, 12.0 MB, 1.50 GB."""
    if count < 1000:
        return f"{count} byte{'s' if count != 1 else ''}"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12)):
        if count < scale * 1000 or unit == "TB":
            return f"{count / scale:.{1 if unit != 'GB' else 2}f} {unit}"
    raise AssertionError(count)


def _progress_bar(plan: ConversionPlan):
    """A progress bar on stderr: bytes and tensors written, rate and ETA; shown after 1 s only."""
    from tqdm import tqdm

    total = sum(tensor.nbytes for tensor in plan.tensors.values())
    count = len(plan.tensors)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", delay=1.0,
               leave=False, dynamic_ncols=True)

    class Progress:
        done = 0

        def __call__(self, nbytes: int) -> None:
            self.done += 1
            bar.set_postfix_str(f"{self.done}/{count} tensors", refresh=False)
            bar.update(nbytes)

        def close(self) -> None:
            bar.close()

    return Progress()



# ---------------------------------------------------------------------------------------------
# Verification


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
        from normswap.rotation import verify_rotated

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


def model_card(provenance: dict) -> str:
    """README.md of a converted checkpoint: what was done, how to load it, and the measured figures."""
    template = MODEL_CARD
    verification = provenance.get("verification")
    table = verify.format_table(verification["loaders"]) if verification else "(not verified)"
    options = provenance["options"]
    return template.format(
        source=provenance["source"],
        auto_class=provenance["auto_class"],
        version=provenance["version"],
        method=options["method"],
        fold_gains=options["fold_gains"],
        dtype=options["dtype"],
        norms=len(provenance["norms_swapped"]),
        folded=len(provenance["norms_folded"]),
        writers=provenance["writers_centred"],
        untied=", ".join(provenance["untied"]) or "nothing (the head was not tied)",
        stock=(
            "Stock transformers loads it and computes the original's outputs exactly."
            if provenance["stock_loadable"]
            else "Stock transformers refuses it on purpose (its model type is "
            "normswap-specific): the stock class would not compute this model."
        ),
        table=table,
        probe=(verification or {}).get("probe", "-"),
        tolerance=(verification or {}).get("tolerance", {}).get("limit", float("nan")),
    )
