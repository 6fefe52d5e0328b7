"""Verification of a converted checkpoint against its original.

``verify_checkpoint`` checks that the two checkpoints belong together, proves every stored tensor
against the conversion plan (``proof``), then runs the original and each load of the conversion
(``loaders``) on one short probe and compares the figures (``compare``): whole models
(``whole``), or block by block above a size (``layerwise``). ``prove_checkpoint`` is the proof alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path

import torch

from normswap.architectures import Architecture
from normswap.arguments import checked
from normswap.checkpoint import validation
from normswap.checkpoint.provenance import Provenance, original_model_type
from normswap.checkpoint.side_files import check_side_files
from normswap.checkpoint.source import CheckpointReader, first_non_finite, read_config, resolve_source
from normswap.convert.install import Verification, check_tolerance
from normswap.convert.plan import ConversionPlan
from normswap.dtypes import default_tolerance
from normswap.errors import NormswapError
from normswap.modeling import build
from normswap.rotate.matrices import load_rotation
from normswap.rotate.plan import family_of
from normswap.runtime import background
from normswap.runtime.checkpoint import Checkpoint, checkpoint_of
from normswap.runtime.loaders import refusals
from normswap.runtime.offload import Unsupported, wants_layerwise
from normswap.runtime.reference import reference_model
from normswap.threads import default_threads, pinned_threads
from normswap.verify import contents
from normswap.verify import layerwise as by_layer
from normswap.verify import proof as weights
from normswap.verify.compare import within_tolerance
from normswap.verify.comparison import Comparison, centred64
from normswap.verify.pairs import check_reference, uncompared_outputs
from normswap.verify.probes import Probe
from normswap.verify.whole import compare_whole


@checked
def verify_checkpoint(original: str | Path, converted: str | Path, *, atol: float | None = None,
                      rtol: float | None = None, layerwise: bool | None = None, quiet: bool = True,
                      trust_remote_code: bool = False, proof: bool = True,
                      plan: ConversionPlan | None = None) -> dict:
    """Compare a converted checkpoint with its original on one probe, in float32.

    Returns the probe, the tolerance, figures per loader (``stock``: stock transformers' class,
    or whether it refuses the checkpoint as it must; ``remote_code``: the RMSNorm model), the
    mode (``full`` or ``layerwise``; ``layerwise=None`` picks by size) and ``passed``.

    The ``remote_code`` figures are those of the RMSNorm class that ``modeling_normswap.py``
    defines. Its code is normswap's own (the checkpoint's file must be byte for byte the one
    this normswap writes, or verification fails); with ``trust_remote_code`` the checkpoint's file
    itself is imported and run instead. Config.json, the side files and the weight files beside the
    proven ones must be what normswap writes for this original too (``contents``).

    First, unless ``proof`` is False, every stored tensor is proven to be what the conversion plan
    makes it (``proof.prove_weights``): a failure raises ``VerificationError`` naming the tensor
    and element, before any model runs (block by block, the proof runs beside the forward passes,
    which then run the first blocks only and stop once it fails: ``proven_and_compared``).
    ``plan`` is the conversion's plan when the caller has it (``convert`` does); else it is
    rebuilt from the original with the options the conversion recorded.
    """
    check_tolerance("atol", atol)
    check_tolerance("rtol", rtol)
    verification = Verification(atol=atol, rtol=rtol, layerwise=layerwise, quiet=quiet,
                                trust_remote_code=trust_remote_code, proof=proof)
    return verify_conversion(Checkpoint.open(original), converted, verification, plan)


def verify_conversion(original: Checkpoint, converted: str | Path, verification: Verification | None = None,
                      plan: ConversionPlan | None = None, written: weights.WrittenProof | None = None) -> dict:
    """``verify_checkpoint`` of the checkpoint ``original`` already opened, as ``verification``
    asks (the verifier ``convert`` runs, handed the plan it wrote and ``written``, the proof it
    took while writing, whose figures stand for the weights proof)."""
    verification = verification or Verification()
    original_dir, converted_dir = original.folder, Path(converted).expanduser()
    provenance, architecture, configs = _check_pair(original, converted_dir, converted, with_contents=False)
    check_contents = partial(contents.check_contents, original_dir, converted_dir, *configs, provenance)
    if provenance.rotation is not None:  # its stream is C·h·Q, not C·h
        check_contents()
        return _compare_rotated(original_dir, converted_dir, provenance, configs, verification, None, None)
    atol, rtol = tolerance(provenance, converted_dir, verification.atol, verification.rtol)
    mode = verification_mode(original_dir, architecture, verification.layerwise)
    proof = verification.proof
    if proof and plan is None:
        plan = weights.rebuilt_conversion_plan(original_dir, configs[0], provenance.options,
                                               stored_tensors(converted_dir))
    original_config = configs[0]
    comparison = Comparison(
        original_dir, converted_dir, architecture,
        reference=lambda: build.load_pretrained(build.model_class(original_config, architecture.auto_class),
                                                original_dir, dtype=torch.float32),
        configs=configs, stock_loadable=provenance.stock_loadable,
        rms_how="remote" if verification.trust_remote_code else "rmsnorm", mode=mode, quiet=verification.quiet,
        tolerance=(atol, rtol), every_block=verification.layerwise is True or not proof)

    def compare(identical: dict[str, str], check: Callable[[], None] | None) -> tuple:
        return run_comparison(comparison, identical, check)

    def prepare() -> None:
        check_contents()
        if plan is not None:
            contents.check_provenance_block(converted_dir, provenance, plan, architecture.auto_class)
        import_classes(original_config, architecture)

    proven, (probe, loaders, mode, note) = proven_and_compared(
        original_dir, converted_dir, plan if proof else None, mode, compare, prepare=prepare,
        beside=verification.layerwise is not True, written=written,
        first=by_layer.probed_tensors(plan.tensors, original_config, architecture.blocks) if plan else ())
    return summarise(probe, loaders, (atol, rtol), (mode, note), provenance.method, (original_dir, converted_dir),
                     **({"proof": proven} if proven is not None else {}))


def proven_and_compared(reference_dir: Path, converted_dir: Path, plan: ConversionPlan | None,
                        mode: tuple[str, str | None],
                        compare: Callable[[dict[str, str], Callable[[], None] | None], tuple],
                        prepare: Callable[[], object] | None = None, beside: bool = True,
                        written: weights.WrittenProof | None = None,
                        first: Collection[str] = ()) -> tuple[dict | None, tuple]:
    """(proof figures or None, ``compare(identical, check)``): the weights proof of ``plan``
    (none without one), then the forward comparison, after ``prepare()``: the checks of the
    folder's other contents and ``import_classes``, which fail before any figure is taken.

    ``written``, the proof taken while the folder was written, stands for the weights proof: its
    figures are taken (the stored inventory checked against the plan) and the comparison follows,
    reading each tensor kept byte for byte once for both checkpoints.

    A whole-model comparison runs after the proof, so that a wrong weight fails before any model
    runs, and so does a block-by-block one of every block (not ``beside``: its forward passes
    take every core). A block-by-block one of the first blocks (``mode``, ``beside``) runs beside
    the proof. For a big checkpoint on Linux the proof runs in a process of its own
    (``runtime.background.InProcess``), started before ``prepare()`` and before transformers is imported:
    seconds of Python that hold the interpreter lock, on one core, while the proof works on the
    other. A failure of ``prepare()`` ends the proof and is raised. The comparison then takes
    every core if the proof is done, else leaves it one. Elsewhere the proof's thread
    (``runtime.background.InThread``) starts after ``prepare()``, which would keep the lock from it, and
    this thread joins its work once the comparison is done. The forward passes share reads with
    the proof only through the page cache: the proof takes first the tensors ``first`` names,
    those the comparison reads (``layerwise.probed_tensors``), so that the cache holds them
    still however big the pair, and each tensor the plan keeps byte for byte (``identical``,
    proven so by the proof) is read once for both checkpoints. ``check`` stops
    the comparison at its next block once the proof has failed, and the proof's failure is raised
    before the comparison's. An interrupt stops the proof too."""
    if written is not None:
        if prepare is not None:
            prepare()
        identical = {}
        proven = written.figures(converted_dir, identical)
        return proven, compare(identical, None)
    if plan is None or mode[0] != "layerwise" or not beside:
        if prepare is not None:
            prepare()
        identical: dict[str, str] = {}
        proven = None if plan is None else weights.prove_weights(reference_dir, converted_dir, plan, identical)
        return proven, compare(identical, None)
    identical = weights.planned_identical(plan, reference_dir)
    proof = weights.WeightsProof(reference_dir, converted_dir, plan, first)
    cores = default_threads() or torch.get_num_threads()  # the user's thread count, when set
    proving: background.InThread | background.InProcess | None = background.in_process(proof, cores)
    try:
        if prepare is not None:
            prepare()
    except BaseException:
        if proving is not None:
            proving.cancel()
        raise
    try:
        if proving is None:  # a thread starts after the import, which would keep the lock from it
            proving = background.InThread(proof)
        with pinned_threads(cores if proving.done() else max(1, cores - 1)):  # a core left to the proof
            compared = compare(identical, proving.check)
    except Exception as error:
        if proving is None:
            raise
        raise proving.outcome(error) from None
    except BaseException:
        if proving is not None:
            proving.cancel()
        raise
    return proving.result(), compared


def import_classes(original_config: dict, architecture: Architecture) -> None:
    """What every comparison needs first: normswap's classes registered with transformers' auto
    classes (a converted config's ``normswap_<type>`` must resolve) and the original's model class
    imported, seconds of Python that a proof in its own process runs beside
    (``proven_and_compared``)."""
    from normswap.modeling.registry import register_auto_classes

    register_auto_classes()
    build.model_class(original_config, architecture.auto_class)


@checked
def prove_checkpoint(original: str | Path, converted: str | Path, *, plan: ConversionPlan | None = None) -> dict:
    """The weights proof alone (``proof.prove_weights``), no model run: the pair is checked as
    ``verify_checkpoint`` checks it, and every stored tensor of ``converted`` is proven against
    ``plan``, or the plan rebuilt from the original with what the provenance records (options;
    for a rotation its method, seed and stored Q). Returns the proof's figures; raises
    ``VerificationError`` naming the first wrong tensor."""
    source, converted_dir = Checkpoint.open(original), Path(converted).expanduser()
    original_dir = source.folder
    provenance, _, configs = _check_pair(source, converted_dir, converted)
    if provenance.rotation is not None:
        return prove_rotated(original_dir, converted_dir, plan=plan, configs=configs)
    return _prove_converted(original_dir, converted_dir, provenance, configs[0], plan)


def _prove_converted(original_dir: Path, converted_dir: Path, provenance: Provenance, original_config: dict,
                     plan: ConversionPlan | None) -> dict:
    if plan is None:
        plan = weights.rebuilt_conversion_plan(original_dir, original_config, provenance.options,
                                               stored_tensors(converted_dir))
    return weights.prove_weights(original_dir, converted_dir, plan)


def prove_rotated(reference: str | Path, rotated: str | Path, *, plan: ConversionPlan | None = None,
                  configs: tuple[dict | None, dict | None] = (None, None)) -> dict:
    """``prove_checkpoint`` for a rotated checkpoint and the checkpoint it was rotated from
    (``configs``: their config.json files, when the caller has read them)."""
    reference_dir, rotated_dir = resolve_source(reference), Path(rotated)
    if plan is None:
        reference_config = read_config(reference_dir) if configs[0] is None else configs[0]
        rotated_config = read_config(rotated_dir) if configs[1] is None else configs[1]
        provenance = Provenance.of(rotated_config, rotated_dir)
        if provenance is None or provenance.rotation is None:
            raise NormswapError(f"{rotated_dir} is not a rotated normswap checkpoint")
        plan = weights.rebuilt_rotation_plan(reference_dir, reference_config, provenance.rotation,
                                             rotation_matrix(rotated_dir, rotated_config), provenance.options,
                                             stored_tensors(rotated_dir))
    return weights.prove_weights(reference_dir, rotated_dir, plan)


def rotation_matrix(rotated_dir: Path, rotated_config: dict) -> torch.Tensor:
    """Q stored beside a rotated checkpoint, checked against its recorded hash and for orthogonality."""

    width = next((rotated_config[key] for key in ("n_embd", "hidden_size", "d_model") if key in rotated_config), None)
    return load_rotation(rotated_dir, width if isinstance(width, int) else None, rotated_config).clone()


def stored_tensors(path: Path) -> dict:
    """Name -> ``TensorInfo`` of the tensors stored at ``path`` (headers only)."""
    with CheckpointReader(path) as reader:
        return dict(reader.tensors)


def _check_pair(original: Checkpoint, converted_dir: Path, converted: str | Path,
                with_contents: bool = True) -> tuple[Provenance, Architecture, tuple[dict, dict]]:
    """The conversion's provenance, the family and the two configs (each config.json read once
    here and passed down), once the pair is known to belong together: its structure, and (with
    ``with_contents``; else the caller's to check) the folder's other contents
    (``contents.check_contents``), which import transformers."""
    if not (converted_dir / "config.json").is_file():
        raise NormswapError(f"{converted} is not a checkpoint folder (it has no config.json)")
    check_side_files(converted_dir)  # as resolve_source does for the original
    original_dir, original_config, converted_config = original.folder, original.config, read_config(converted_dir)
    block = converted_config.get("normswap")
    if block is None and "normswap" not in original_config:
        raise NormswapError(f"{converted_dir} is not a normswap checkpoint (its config.json has no normswap block)")
    if isinstance(block, dict) and isinstance(block.get("slicing"), dict):
        sliced = block["slicing"]
        raise NormswapError(f"{converted_dir} is sliced ({sliced.get('original_hidden_size')} → "
                            f"{sliced.get('hidden_size')} dimensions), which is not exact, so there is nothing to "
                            "verify; its perplexity cost is in config.json under normswap.slicing.perplexity")
    provenance = None if block is None else Provenance.of(converted_config, converted_dir)
    check_reference(original_dir, original_config, converted_dir, provenance)
    for path, config in ((original_dir, original_config), (converted_dir, converted_config)):
        validation.check_structure(path, config)
    architecture = original.architecture
    if provenance.original_model_type != original_model_type(original_config):
        raise NormswapError(f"{converted_dir} was converted from a {provenance.original_model_type} model, "
                            f"but {original_dir} is a {original_model_type(original_config)} model")
    validation.check_same_shape(original_dir, original_config, converted_dir, converted_config)
    if with_contents:
        contents.check_contents(original_dir, converted_dir, original_config, converted_config, provenance)
    return provenance, architecture, (original_config, converted_config)


def tolerance(provenance: Provenance, converted_dir: Path, atol: float | None,
              rtol: float | None) -> tuple[float, float]:
    """(atol, rtol): those given, else the defaults for the dtype the conversion is stored in
    (its tensors' headers: ``contents.stored_dtype``), never for the dtype it records."""
    default_atol, default_rtol = default_tolerance(contents.stored_dtype(converted_dir, provenance))
    return default_atol if atol is None else atol, default_rtol if rtol is None else rtol


def verification_mode(reference_dir: Path, architecture: Architecture,
                      layerwise: bool | None) -> tuple[str, str | None]:
    """(mode, note): ``layerwise`` when asked for, or (``layerwise=None``) when the model is too big
    to hold twice, and its kind can be run that way; else ``full``. Whether this model's
    structure allows it is found when it is built to run (``run_comparison`` falls back)."""
    if layerwise is False:
        return "full", None
    if layerwise is None and not wants_layerwise(reference_dir):
        return "full", None
    if architecture.probe != "causal_lm":
        return "full", (f"layer by layer unavailable (layer-by-layer verification covers causal LMs; this is a "
                        f"{architecture.probe} model); compared whole models")
    return "layerwise", None


def run_comparison(comparison: Comparison, identical: dict[str, str] | None = None,
                   check: Callable[[], None] | None = None) -> tuple[Probe, dict[str, dict], str, str | None]:
    """(probe, figures per loader, mode, note): block by block when ``comparison.mode`` (a
    ``verification_mode`` answer) says so and the model allows it, else whole models.

    ``identical``: tensors the weights proof found byte-identical in both checkpoints (converted
    name -> original name), which a block-by-block run reads once for both; ``check`` runs after
    every block of one (it raises to stop the run)."""
    mode, note = comparison.mode
    refused = refusals(comparison.converted_dir, comparison.stock_loadable, comparison.configs[1])
    if mode == "layerwise":
        tolerance = comparison.tolerance
        try:
            probe, compared = by_layer.compare_layerwise(
                comparison, passes=None if tolerance is None else partial(within_tolerance, atol=tolerance[0],
                                                                          rtol=tolerance[1]),
                identical=identical, check=check)
            return probe, {**refused, **compared}, mode, note
        except Unsupported as error:
            mode, note = "full", f"layer by layer unavailable ({error}); compared whole models"
    if comparison.reference is None:
        raise TypeError("a whole-model comparison needs the reference model's builder")
    probe, compared = compare_whole(comparison.reference, comparison.reference_dir, comparison.converted_dir,
                                    comparison.architecture, stock_loadable=comparison.stock_loadable,
                                    rms_how=comparison.rms_how, converted_config=comparison.configs[1],
                                    skip=comparison.skip)
    return probe, {**refused, **compared}, mode, note


def summarise(probe: Probe, loaders: dict[str, dict], tolerance: tuple[float, float], how: tuple[str, str | None],
              method: str, paths: tuple[Path, Path], **extra: object) -> dict:
    """The verification result: each compared loader judged against the ``tolerance`` (atol,
    rtol), and the verdict; ``how`` is the comparison's (mode, note)."""
    (atol, rtol), (mode, note) = tolerance, how
    compared = [figures for figures in loaders.values() if "max_abs_diff" in figures]
    if not all(math.isfinite(figures["max_abs_diff"]) and math.isfinite(figures["max_abs_reference"])
               for figures in compared):
        _refuse_non_finite(*paths)
    for figures in compared:
        figures["passed"] = within_tolerance(figures, atol, rtol)
    limit = atol + rtol * max(figures["max_abs_reference"] for figures in compared)
    passed = all(figures["passed"] for figures in compared) and all(
        figures.get("refused", True) for figures in loaders.values()
    )
    return {
        "probe": probe.kind,
        "probe_shape": list(next(iter(probe.inputs.values())).shape),
        "compute_dtype": "float32",
        "method": method,
        **extra,
        "tolerance": {"atol": atol, "rtol": rtol, "limit": limit},
        "loaders": loaders,
        "passed": passed,
        "mode": mode,
        **({"note": note} if note else {}),
        **({"worst_layer": _worst_layer(loaders)} if mode == "layerwise" else {}),
        **_blocks_run(loaders),
    }


def _blocks_run(loaders: dict[str, dict]) -> dict:
    """``{"blocks": {"run": [...], "of": n}}`` when a block-by-block comparison ran sampled blocks."""
    blocks = next((figures["blocks"] for figures in loaders.values() if "blocks" in figures), None)
    return {} if blocks is None else {"blocks": blocks}


def _refuse_non_finite(original_dir: Path, converted_dir: Path) -> None:
    """The outputs are NaN or infinite: name the weight responsible, in one line."""
    for path, role in ((original_dir, "original"), (converted_dir, "converted")):
        name = first_non_finite(path)
        if name is not None:
            raise NormswapError(f"the {role} checkpoint {path} has NaN or infinite values in tensor {name}; "
                                "its outputs cannot be compared")
    raise NormswapError("the models' outputs are NaN or infinite on the probe although every weight is finite")


def _worst_layer(loaders: dict[str, dict]) -> dict:
    """The worst block over the loaders compared layer by layer, with the loader named: a block's
    own error (teacher-forced, measured for a failing loader) before any stream error."""
    ranked = [(figures["worst_layer"].get("teacher_forced", True), figures["worst_layer"]["relative"], name)
              for name, figures in loaders.items() if "worst_layer" in figures]
    *_, name = max(ranked)
    return {"loader": name, **loaders[name]["worst_layer"]}


def verify_rotation(reference: Checkpoint | str | Path, rotated: str | Path,
                    verification: Verification | None = None, plan: ConversionPlan | None = None,
                    written: weights.WrittenProof | None = None) -> dict:
    """Compare a rotated checkpoint with the checkpoint it was rotated from (an original or a
    folded conversion): first every stored tensor against the rotation plan (``proof``; ``plan``
    is the plan the rotation ran, else it is rebuilt from the recorded form, method, seed and the
    stored Q; ``written``, the proof the rotation took while writing, stands for it), then
    logits, and per block the stream, which must be h·Q (C·h·Q for the free form, whose stream is
    centred).

    The free form's model is built from normswap's own RMSNorm classes (with
    ``verification.trust_remote_code`` the checkpoint's ``modeling_normswap.py`` runs instead).
    The commuting form's is loaded with the stock class, and with the RMSNorm class too where its
    stream is centred (a folded source); the outputs that come out rotated (``rotated_outputs``)
    are not compared."""
    reference, verification = checkpoint_of(reference), verification or Verification()
    reference_dir, rotated_dir = reference.folder, Path(rotated)
    reference_config, rotated_config = reference.config, read_config(rotated_dir)
    provenance = Provenance.of(rotated_config, rotated_dir)
    if provenance is None or provenance.rotation is None:
        raise NormswapError(f"{rotated_dir} is not a rotated normswap checkpoint")
    contents.check_contents(reference_dir, rotated_dir, reference_config, rotated_config, provenance)
    return _compare_rotated(reference_dir, rotated_dir, provenance, (reference_config, rotated_config),
                            verification, plan, written)


def _compare_rotated(reference_dir: Path, rotated_dir: Path, provenance: Provenance, configs: tuple[dict, dict],
                     verification: Verification, plan: ConversionPlan | None,
                     written: weights.WrittenProof | None) -> dict:
    """``verify_rotation`` once the pair's contents are checked: the proof, then the comparison."""

    reference_config, rotated_config = configs
    rotation = rotation_matrix(rotated_dir, rotated_config)
    architecture, _, reference_block = family_of(reference_dir, reference_config)
    proof, layerwise = verification.proof, verification.layerwise
    if proof and plan is None and written is None:
        plan = weights.rebuilt_rotation_plan(reference_dir, reference_config, provenance.rotation or {}, rotation,
                                             provenance.options, stored_tensors(rotated_dir))
    atol, rtol = tolerance(provenance, rotated_dir, verification.atol, verification.rtol)
    if (reference_block or {}).get("stock_loadable", True):
        mode = verification_mode(reference_dir, architecture, layerwise)
    else:
        mode = ("full", "layer by layer needs a reference the stock class loads; compared whole models")
    rotation_block = provenance.rotation or {}
    form, centred = rotation_block.get("form", "free"), provenance.rmsnorm_exact

    def stream_map(hidden: torch.Tensor) -> torch.Tensor:
        return (centred64(hidden) if centred else hidden.double()) @ rotation

    rms_how = "remote" if verification.trust_remote_code else "rmsnorm"
    comparison = Comparison(
        reference_dir, rotated_dir, architecture,
        reference=lambda: reference_model(reference_dir, architecture, rms_how=rms_how, config=reference_config),
        configs=(reference_config, rotated_config),
        stock_loadable=form == "commuting" and provenance.stock_loadable, rms_how=rms_how if centred else None,
        mode=mode, quiet=verification.quiet, stream_map=stream_map, tolerance=(atol, rtol),
        skip=uncompared_outputs(architecture, reference_config, rotation_block, rotated_dir),
        every_block=layerwise is True or not proof)

    def compare(identical: dict[str, str], check: Callable[[], None] | None) -> tuple:
        return run_comparison(comparison, None, check)

    proven, (probe, loaders, mode, note) = proven_and_compared(
        reference_dir, rotated_dir, plan if proof else None, mode, compare,
        prepare=partial(import_classes, reference_config, architecture), beside=layerwise is not True,
        written=written,
        first=by_layer.probed_tensors(plan.tensors, reference_config, architecture.blocks) if plan else ())
    return summarise(probe, loaders, (atol, rtol), (mode, note), "exact", (reference_dir, rotated_dir),
                     reference="source", **({"proof": proven} if proven is not None else {}))
