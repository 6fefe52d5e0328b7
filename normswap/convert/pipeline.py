"""The conversion pipeline: load → plan → fold → write → verify, atomically.

``convert_checkpoint`` writes into a temporary directory beside ``out`` and installs it only after
verification passed (``normswap.output``), so a failed or interrupted conversion leaves nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from normswap import __version__, output, validation
from normswap.architectures import IDENTITY, Architecture, architecture_for
from normswap.card import MODEL_CARD
from normswap.convert.plan import ConversionPlan, build_plan
from normswap.convert.source import CheckpointReader, read_config, resolve_source
from normswap.convert.write import copy_side_files, write_json, write_weights
from normswap.errors import NormswapError, VerificationError
from normswap.modeling import build, remote
from normswap.verify import compare as verify

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
                from normswap.verify.checkpoint import verify_checkpoint

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
