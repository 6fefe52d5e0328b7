"""Provenance: the typed view of a normswap checkpoint's ``config["normswap"]`` block.

Every normswap checkpoint records how it was made in its config.json: the model type it was
converted from, the options, the structural changes its RMSNorm class performs, and for a rotated
or sliced checkpoint the rotation or slicing. ``Provenance.of`` checks the block once
(``validation.check_provenance``) and gives it typed; code that follows a checkpoint through a
command receives the parsed config and this view rather than reading config.json again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from normswap.checkpoint import validation
from normswap.checkpoint.names import ROTATION_FILE
from normswap.checkpoint.rotations import ROTATION_FORMS, ROTATION_METHODS, rotation_method
from normswap.errors import NormswapError, quoted

# the kinds of ``normswap.convert.steps.Structure`` (a test keeps the two in step)
STRUCTURE_KINDS = ("identity", "centre_input", "centre_output", "gain_plus_one")
WIDTH_KEYS = ("n_embd", "hidden_size", "d_model")
_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class Provenance:
    """A checked ``normswap`` block: what a converted checkpoint was made from and how."""

    original_model_type: str | None
    options: dict = field(default_factory=dict)  # method, fold_gains, dtype
    structure: dict = field(default_factory=dict)  # Structure.to_json(): identity / centre_* module paths
    stock_loadable: bool = True
    modeling_sha256: str | None = None
    rotation: dict | None = None
    slicing: dict | None = None
    block: dict = field(default_factory=dict, repr=False)  # the block as written

    @classmethod
    def of(cls, config: dict, path: Path) -> Provenance | None:
        """The checked provenance of the checkpoint at ``path`` whose config is ``config``, or
        None for a checkpoint normswap did not write; a malformed block is a one-line refusal."""
        block = config.get("normswap")
        if block is None:
            return None
        validation.check_provenance(block, path)
        where = f"{path / 'config.json'}: normswap"
        _check_counts(block, where)
        if "rotation" in block:
            check_rotation(block["rotation"], config, f"{where}.rotation")
        if "slicing" in block:
            check_slicing(block["slicing"], f"{where}.slicing")
        return cls(
            original_model_type=block.get("original_model_type", config.get("model_type")),
            options=block.get("options", {}), structure=block.get("structure", {}),
            stock_loadable=block.get("stock_loadable", True), modeling_sha256=block.get("modeling_sha256"),
            rotation=block.get("rotation"), slicing=block.get("slicing"), block=block,
        )

    @property
    def rotated_from_conversion(self) -> bool:
        """Whether this is a rotation of a (folded) normswap conversion, which it was checked against,
        rather than of an original."""
        return self.rotation is not None and "rotated_from" in self.block

    @property
    def method(self) -> str:
        return self.options.get("method", "exact")

    @property
    def rmsnorm_exact(self) -> bool:
        """Whether the RMSNorm class computes the checkpoint: not for a commuting rotation of an
        uncentred stream (``rotation.centred`` false), which only the stock LayerNorm class computes."""
        return (self.rotation or {}).get("centred", True) is not False


def original_model_type(config: dict) -> str | None:
    """The model type a checkpoint's family is known by: the one it was converted from, for a
    normswap checkpoint (whose own type may be ``normswap_<type>``), else its own."""
    block = config.get("normswap")
    if isinstance(block, dict) and isinstance(block.get("original_model_type"), str):
        return block["original_model_type"]
    return config.get("model_type")


def family_config(config: dict) -> dict:
    """``config`` as its original family describes it: the model type restored (``original_model_type``)."""
    return {**config, "model_type": original_model_type(config)}


def _refuse(where: str, key: str, wanted: str, value: object) -> None:
    raise NormswapError(f"{where}.{key} must be {wanted} (got {quoted(value, 60)})")


def _count(value: object, low: int = 0, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value < high))


def _names(value: object, kinds: tuple[type, ...] = (str,)) -> bool:
    """A mapping of strings to ``kinds``."""
    return isinstance(value, dict) and all(isinstance(key, str) and isinstance(item, kinds)
                                           for key, item in value.items())


def _check_counts(block: dict, where: str) -> None:
    if "writers_centred" in block and not _count(block["writers_centred"]):
        _refuse(where, "writers_centred", "a count (an integer from 0)", block["writers_centred"])
    for kind in block.get("structure", {}):
        if kind not in STRUCTURE_KINDS:
            raise NormswapError(f"{where}.structure has an unknown kind {quoted(kind, 60)}; normswap "
                                f"writes {', '.join(STRUCTURE_KINDS)}")


def check_rotation(rotation: object, config: dict, where: str) -> None:
    """Refuse a rotation record normswap would not write, in one line naming the key: Q's method,
    seed, dimension (the model's width), hash and file, the form and what it records."""
    if not isinstance(rotation, dict):
        raise NormswapError(f"{where} must be a mapping")
    method = rotation_method(rotation.get("method"))
    if method is None:
        _refuse(where, "method", f"one of {', '.join(ROTATION_METHODS)}", rotation.get("method"))
    seed = rotation.get("seed")
    if method.calibrated and seed is not None:
        _refuse(where, "seed", f"null for a {method.name} rotation (its Q is measured, not seeded)", seed)
    if method.seeded and not _count(seed, 0, _SEED_LIMIT):
        _refuse(where, "seed", "an integer from 0 to 2**63 - 1", seed)
    width = next((config[key] for key in WIDTH_KEYS if _count(config.get(key), 1)), None)
    dimension = rotation.get("dimension")
    if not _count(dimension, 1) or (width is not None and dimension != width):
        _refuse(where, "dimension", f"the model's width {width}" if width else "a positive integer", dimension)
    sha = rotation.get("matrix_sha256")
    if not (isinstance(sha, str) and len(sha) == 64 and all(char in "0123456789abcdef" for char in sha)):
        _refuse(where, "matrix_sha256", "a sha256 in hex", sha)
    if rotation.get("matrix_file", ROTATION_FILE) != ROTATION_FILE:
        _refuse(where, "matrix_file", f"{ROTATION_FILE} (the file normswap writes)", rotation.get("matrix_file"))
    if rotation.get("form", "free") not in ROTATION_FORMS:
        _refuse(where, "form", f"one of {', '.join(ROTATION_FORMS)}", rotation.get("form"))
    for key, wanted, words in (("construction", str, "a string"), ("centred", bool, "true or false"),
                               ("calibration", dict, "a mapping"), ("online_hadamard", dict, "a mapping")):
        if key in rotation and not isinstance(rotation[key], wanted):
            _refuse(where, key, words, rotation[key])
    for key in ("fixed_streams", "rotated_outputs"):
        if key in rotation and not _names(rotation[key]):
            _refuse(where, key, "a mapping of names to names", rotation[key])
    if "rotated" in rotation and not _names(rotation["rotated"], (int,)):
        _refuse(where, "rotated", "a mapping of kinds to counts", rotation["rotated"])


def check_slicing(slicing: object, where: str) -> None:
    """Refuse a slicing record ``apply_slicing`` could not follow, in one line naming the key."""
    if not isinstance(slicing, dict):
        raise NormswapError(f"{where} must be a mapping")
    for key in ("hidden_size", "original_hidden_size"):
        if not _count(slicing.get(key), 1):
            _refuse(where, key, "a positive integer", slicing.get(key))
    if slicing["hidden_size"] > slicing["original_hidden_size"]:
        _refuse(where, "hidden_size", f"at most original_hidden_size {slicing['original_hidden_size']}",
                slicing["hidden_size"])
    if not isinstance(slicing.get("blocks"), str):
        _refuse(where, "blocks", "a module name", slicing.get("blocks"))
    for key, kinds in (("stream_axes", (str, int)), ("branches", (str, str))):
        pairs = slicing.get(key)
        if not isinstance(pairs, list) or not all(
                isinstance(pair, list) and len(pair) == 2 and all(isinstance(item, kind) and not isinstance(item, bool)
                                                                  for item, kind in zip(pair, kinds, strict=True))
                for pair in pairs):
            _refuse(where, key, "a list of pairs", pairs)
    for pattern, _ in slicing["stream_axes"]:
        try:
            re.compile(pattern)
        except re.error:
            _refuse(where, "stream_axes", "a list of (regular expression, axis) pairs", pattern)
