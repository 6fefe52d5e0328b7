"""What a converted checkpoint folder holds besides the tensors the weights proof covers, held to
what normswap writes for its original.

The proof and the probe see only the stored tensors and the keys that shape the model. Everything
else a loader reads is checked here, each failure one line (``VerificationError``):

* ``check_modeling_file``: ``modeling_normswap.py`` is byte for byte the file this normswap
  writes, whatever config.json records (the file runs with ``trust_remote_code``); a config with
  no ``auto_map`` (a stock-loadable output) loads no class of it, so it must be absent.
* ``check_config``: config.json is the original's but for the keys ``convert.card.converted_config``
  rewrites (``architectures``, ``auto_map``, ``model_type``, the tie flag, ``dtype`` /
  ``torch_dtype``, the ``normswap`` block), and those hold what it writes.
* ``check_weight_files``: no weight file beside the ones the checkpoint's reader takes (a second
  set, read by ``use_safetensors=False`` or by a tool that globs weights, is never proven).
* ``check_side_files``: the tokenizer, processor and generation files are the original's, as
  ``convert.write.copy_side_files`` copies them (a JSON file's ``auto_map`` dropped).
* ``check_other_files``: nothing else is there (code, folders, notes), but the stored rotation of
  a rotated checkpoint and hidden entries such as a hub repository's ``.gitattributes``.
* ``stored_dtype``: the least precise stored floating dtype, which sets the tolerance; the
  recorded ``options.dtype`` must name it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from normswap.architectures import Architecture
from normswap.checkpoint.bounded import read_json
from normswap.checkpoint.files import SIDE_FILES, inside_file
from normswap.checkpoint.marker import MARKER, paths_under
from normswap.checkpoint.provenance import Provenance
from normswap.checkpoint.side_files import TOKENIZER_FILES
from normswap.checkpoint.source import SAFETENSORS_INDEX, CheckpointReader
from normswap.convert import card
from normswap.convert.plan import ConversionPlan
from normswap.dtypes import canonical_name, dtype_name, is_floating, least_precise
from normswap.errors import NormswapError, VerificationError, quoted
from normswap.modeling import MODELING_FILE, build, modeling_sha256
from normswap.rotate.matrices import ROTATION_FILE, rotation_block
from normswap.rotate.plan import family_of

# the keys of config.json that convert and rotate rewrite (the tie flag is the family's own)
REWRITTEN_KEYS = ("architectures", "auto_map", "model_type", "dtype", "torch_dtype", "normswap")
# file names of weights in any format transformers, its siblings or other runtimes read
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".ggml",
                   ".onnx", ".npz", ".npy", ".pkl", ".pickle", ".keras", ".tflite", ".pb", ".index.json")


def check_modeling_file(path: Path, config: dict) -> None:
    """Fail verification unless ``modeling_normswap.py`` is byte for byte the file this normswap
    writes (``modeling.modeling_sha256``), whatever config.json records; a config without
    ``auto_map`` (a stock-loadable output) names no class of the file, so it must not be there."""
    file = path / MODELING_FILE
    if not config.get("auto_map"):
        if os.path.lexists(file):
            raise VerificationError(f"{path} holds {MODELING_FILE}, but its config.json has no auto_map, so nothing "
                                    "loads it; a stock checkpoint holds no modeling code, so remove it")
        return
    if inside_file(path, MODELING_FILE) is None:
        raise VerificationError(f"{path} has no {MODELING_FILE}; it is not a complete normswap checkpoint")
    actual, expected = hashlib.sha256(file.read_bytes()).hexdigest(), modeling_sha256()
    if actual != expected:
        raise VerificationError(
            f"{file} differs from the file normswap writes (sha256 {actual[:16]}..., expected {expected[:16]}...): "
            "it was changed after conversion, or written by another normswap version"
        )


def check_config(source: dict, converted_config: dict, architecture: Architecture, provenance: Provenance,
                 where: Path) -> None:
    """config.json of the conversion is ``source``'s (the config it was written from:
    ``rotate.plan.family_of``'s for a folded source) but for the keys normswap rewrites, which
    hold what ``card.converted_config`` writes; one line naming the key. ``dtype`` may name the
    recorded ``options.dtype``, which ``stored_dtype`` holds to the stored tensors."""
    from normswap.modeling import remote

    label = _dtype_label(_recorded_dtype(provenance))
    tie_flag = architecture.tie_flag
    for key in sorted(set(source) | set(converted_config), key=str):
        if key not in (*REWRITTEN_KEYS, tie_flag) and not _same(key, source, converted_config):
            _config_failure(where, key, source, converted_config)
    untied = bool(provenance.block.get("untied"))  # the heads convert untied: the flag is then False
    if not untied and not _same(tie_flag, source, converted_config):
        _config_failure(where, tie_flag, source, converted_config)
    for key in ("dtype", "torch_dtype"):  # rewritten for a checkpoint of one floating dtype; never added
        rewritten = label is not None and converted_config.get(key) == label and (key == "dtype" or key in source)
        if not _same(key, source, converted_config) and not rewritten:
            _config_failure(where, key, source, converted_config)
    model_name, config_name = build.class_names(source, architecture.auto_class)
    model_type = source.get("model_type")
    block = {**provenance.block, "stock_loadable": provenance.stock_loadable, "rotation": provenance.rotation or {}}
    expected = {
        "architectures": [model_name],
        "model_type": model_type if provenance.stock_loadable else remote.MODEL_TYPE_PREFIX + str(model_type),
        "auto_map": card.auto_map(model_type, model_name, config_name, architecture.auto_class, block),
        **({tie_flag: False} if untied else {}),
    }
    for key, value in expected.items():
        found = converted_config.get(key, _ABSENT)
        if _canonical(found) != _canonical(_ABSENT if value is None else value):
            kind = "remote-code entry points" if key == "auto_map" else "value"
            raise VerificationError(f"{where}: config.json key {key!r} is not the {kind} normswap writes for this "
                                    f"checkpoint ({_shown(found)}, expected {_shown(_ABSENT if value is None else value)})")


def _same(key: object, source: dict, converted: dict) -> bool:
    return _canonical(source.get(key, _ABSENT)) == _canonical(converted.get(key, _ABSENT))


_ABSENT = object()


def _canonical(value: object) -> object:
    return value if value is _ABSENT else json.dumps(value, sort_keys=True)


def _shown(value: object, limit: int = 60) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, sort_keys=True)  # ASCII: no control character reaches the terminal
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _config_failure(where: Path, key: object, source: dict, converted: dict) -> None:
    raise VerificationError(f"{where}: config.json key {quoted(str(key), 60)} differs from the original's "
                            f"({_shown(converted.get(key, _ABSENT))}, original {_shown(source.get(key, _ABSENT))}); "
                            "normswap changes only the keys it rewrites")


def check_weight_files(path: Path) -> None:
    """Refuse any weight file in ``path`` (``WEIGHT_SUFFIXES``, at any depth) but the shards the
    checkpoint's reader takes and their index, and, where the folder has normswap's marker, any
    of those it does not list: one line naming the file."""
    with CheckpointReader(path) as reader:
        allowed = set(reader.shards)
    if (path / SAFETENSORS_INDEX).is_file():
        allowed.add(SAFETENSORS_INDEX)
    listed = _marker_paths(path)
    for name in paths_under(path):
        if name.lower().endswith(WEIGHT_SUFFIXES) and (name not in allowed or (listed is not None
                                                                                and name not in listed)):
            raise VerificationError(f"{path} holds {quoted(name, 80)}, a weight file normswap did not write; "
                                    "a second set of weights is never verified, so remove it")


def _marker_paths(path: Path) -> set[str] | None:
    """The paths normswap's marker in ``path`` lists; None without a readable marker (a folder
    being verified before it is installed has none yet)."""
    if inside_file(path, MARKER) is None:
        return None
    try:
        listed = json.loads((path / MARKER).read_text(encoding="utf-8")).get("paths")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return None
    return {entry for entry in listed if isinstance(entry, str)} if isinstance(listed, list) else None


# what normswap writes into a checkpoint folder besides its weight files and the side files
WRITTEN_FILES = ("config.json", MODELING_FILE, "README.md")


def check_other_files(path: Path, records: tuple[str, ...] = ()) -> None:
    """Refuse any entry of ``path`` that normswap does not write: ``WRITTEN_FILES``, each a
    regular file inside the folder, the side files (``check_side_files`` holds them to the
    original's) and weight files (``check_weight_files`` judges those), and no folder. Hidden
    entries (a name starting with a dot: ``.gitattributes``, a clone's ``.git``, normswap's
    marker) are left alone; nothing reads them as the model's."""
    with os.scandir(path) as entries:
        names = sorted((entry.name, entry.is_dir()) for entry in entries)
    for name, is_folder in names:
        if name.startswith(".") or name.lower().endswith(WEIGHT_SUFFIXES):
            continue
        if name in (*WRITTEN_FILES, *records) and not is_folder:
            inside_file(path, name)
            continue
        if name in SIDE_FILES and not is_folder:
            continue
        kind = "folder" if is_folder else "file"
        raise VerificationError(f"{path} holds {quoted(name, 80)}, a {kind} normswap does not write; "
                                "verification proves the folder holds only what normswap writes, so remove it")


# the keys of a conversion's ``normswap`` block that its plan settles (``card.provenance_block``);
# the others record the run (``source`` as the user named it, ``version``, the ``verification``
# figures, whose last digits move with the thread count)
PLANNED_KEYS = ("original_model_type", "norms_swapped", "norms_folded", "writers_centred", "untied",
                "stock_loadable", "structure", "auto_class", "modeling_sha256")
# the options a conversion records (``convert.pipeline``), from which verify rebuilds its plan
OPTION_KEYS = ("method", "fold_gains", "dtype")


def check_provenance_block(path: Path, provenance: Provenance, plan: ConversionPlan, auto_class: str) -> None:
    """The conversion's ``normswap`` block states what ``plan`` (rebuilt from the original with the
    recorded options, or the plan convert ran) did: each of ``PLANNED_KEYS``, one line naming the
    first that differs."""
    expected = card.provenance_block("", plan, provenance.options, auto_class)
    for keys, written, where in ((provenance.block, {*expected, "verification"}, "normswap"),
                                 (provenance.options, OPTION_KEYS, "normswap.options")):
        unknown = sorted((key for key in keys if key not in written), key=str)
        if unknown:
            raise VerificationError(f"{path}: config.json key {quoted(f'{where}.{unknown[0]}', 80)} is not one "
                                    "normswap writes for a conversion")
    for key in PLANNED_KEYS:
        found = provenance.block.get(key, _ABSENT)
        if _canonical(found) != _canonical(expected[key]):
            raise VerificationError(f"{path}: config.json key 'normswap.{key}' is not what the conversion did "
                                    f"({_shown(found)}, expected {_shown(expected[key])})")


def check_side_files(original_dir: Path, converted_dir: Path) -> None:
    """Each side file (``checkpoint.files.SIDE_FILES``) the original has is in the conversion and
    equal to the original's (a JSON file compared once the original's ``auto_map`` is dropped, as
    convert drops it); one the original lacks is absent too."""
    for name in SIDE_FILES:
        original, converted = inside_file(original_dir, name), inside_file(converted_dir, name)
        if original is None and converted is None:
            continue
        if converted is None:
            raise VerificationError(f"{converted_dir} lacks {name}, which the original {original_dir} has")
        if original is None:
            raise VerificationError(f"{converted_dir} holds {name}, which the original {original_dir} lacks; "
                                    "normswap copies only the original's side files")
        if not _same_side_file(original, converted, name):
            raise VerificationError(f"{converted_dir / name} differs from the original's {original_dir / name}; "
                                    "normswap copies side files as they are")


def _same_side_file(original: Path, converted: Path, name: str) -> bool:
    original_bytes, converted_bytes = original.read_bytes(), converted.read_bytes()
    if original_bytes == converted_bytes or not name.endswith(".json"):
        return original_bytes == converted_bytes
    walk = name not in TOKENIZER_FILES
    try:
        source, copied = (read_json(path, mapping=False, walk=walk) for path in (original, converted))
    except NormswapError:
        return False
    if isinstance(source, dict):
        source = {key: value for key, value in source.items() if key != "auto_map"}
    return _canonical(source) == _canonical(copied)


def stored_dtype(path: Path, provenance: Provenance) -> str:
    """The least precise floating dtype stored in ``path`` (headers only), which sets the default
    tolerance; the ``options.dtype`` the conversion records must name it."""
    with CheckpointReader(path) as reader:
        stored = least_precise({info.dtype_name for info in reader.tensors.values() if is_floating(info.dtype_name)})
    label = _recorded_dtype(provenance)
    if label is not None and _dtype_label(label) != stored:
        raise VerificationError(f"{path}: config.json records normswap.options.dtype {_shown(label)}, but its "
                                f"weights are stored as {stored}")
    return stored


def _recorded_dtype(provenance: Provenance) -> object:
    return provenance.options.get("dtype") if isinstance(provenance.options, dict) else None


def _dtype_label(label: object) -> str | None:
    """The canonical name of a recorded dtype label; None for none or one that names no dtype."""
    if not isinstance(label, str):
        return None
    try:
        return dtype_name(canonical_name(label))
    except NormswapError:
        return None


def check_contents(reference_dir: Path, converted_dir: Path, reference_config: dict, converted_config: dict,
                   provenance: Provenance) -> None:
    """Every check of this module for a conversion (or rotation) of the checkpoint at
    ``reference_dir``: the weight files, the side files, config.json, the modeling file."""

    if provenance.rotation is not None:
        rotation_block(converted_dir, converted_config)
    check_weight_files(converted_dir)
    check_side_files(reference_dir, converted_dir)
    architecture, source, _ = family_of(reference_dir, reference_config)
    check_config(source, converted_config, architecture, provenance, converted_dir)
    check_modeling_file(converted_dir, converted_config)  # after config.json's auto_map is proven
    check_other_files(converted_dir, (ROTATION_FILE,) if provenance.rotation is not None else ())
