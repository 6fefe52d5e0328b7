"""Checks of a checkpoint's config.json against itself and its weight headers, before any work.

transformers trusts config.json: a string ``n_embd``, heads that do not divide the width, or a
layer count far above the weights' make model building fail deep inside (or run for minutes
building thousands of layers). These checks run in milliseconds on the parsed JSON and the
tensor names, and say in one line which key is wrong and why. The per-key rules are keyed by the
names transformers' configs use, so they hold for every family that uses a name. A converted
checkpoint's ``normswap`` block is checked the same way before anything relies on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

from normswap.checkpoint.side_files import check_steering_keys
from normswap.checkpoint.source import CheckpointReader
from normswap.dtypes import DTYPE_NAMES
from normswap.errors import NormswapError

# counts and sizes: a positive integer (or null where the family computes a default)
POSITIVE_INTS = (
    "n_embd", "hidden_size", "d_model", "n_head", "num_attention_heads", "num_heads",
    "encoder_attention_heads", "decoder_attention_heads", "num_key_value_heads", "n_layer",
    "num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers", "vocab_size", "n_positions",
    "n_ctx", "max_position_embeddings", "intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim",
    "decoder_ffn_dim", "num_mel_bins", "max_source_positions", "max_target_positions", "num_channels",
    "projection_dim", "word_embed_proj_dim", "rotary_dim", "head_dim",
)
# sizes that may also be a [height, width] pair
POSITIVE_INT_OR_PAIR = ("image_size", "patch_size")
EPSILONS = ("layer_norm_epsilon", "layer_norm_eps")
BOOLEANS = ("tie_word_embeddings", "scale_attn_weights", "add_cross_attention")
ACTIVATIONS = ("activation_function", "hidden_act")
# (width, heads): the width must split evenly over the heads unless head_dim is given
DIVISIBLE = (
    ("n_embd", "n_head"), ("hidden_size", "num_attention_heads"), ("hidden_size", "n_head"),
    ("hidden_size", "num_heads"), ("d_model", "encoder_attention_heads"), ("d_model", "decoder_attention_heads"),
)
# the share of each head that rotary positions turn (transformers reads it at the top level or
# among the rope parameters): a number in [0, 1]
ROTARY_FRACTIONS = ("partial_rotary_factor", "rotary_pct")
ROPE_BLOCKS = ("rope_parameters", "rope_scaling")
HEAD_COUNTS = ("n_head", "num_attention_heads", "num_heads")
WIDTHS = ("n_embd", "hidden_size", "d_model")
LAYER_COUNTS = ("n_layer", "num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers")
SUB_CONFIGS = ("text_config", "vision_config")
# keys transformers reads as a nested config wherever they are set (``get_text_config``, the
# probes): in a family whose config class has no such sub-config, a value there breaks it
NESTED_CONFIG_KEYS = ("text_config", "vision_config", "decoder", "generator", "text_encoder")
# transformers builds an id -> label table of ``num_labels`` entries with the config object (about
# 100 bytes each): far above any labelled data set, far below a size that fills memory
MAX_LABELS = 1_000_000
# the index of a residual block in a tensor name: transformer.h.3., model.layers.3., encoder.layer.3.
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:h|layers?|blocks)\.(\d+)\.")


def check_config(config: dict, where: str) -> None:
    """Refuse a config.json whose values cannot describe a model (``where`` names the file)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise NormswapError(f"{where}: 'model_type' must be a string (got {_show(model_type)})")
    architectures = config.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures)
    ):
        raise NormswapError(f"{where}: 'architectures' must be a list of class names (got {_show(architectures)})")
    check_steering_keys(config, where)  # also checked on every checkpoint folder a command reads
    _check_nested_configs(config, model_type, where)
    _check_values(config, where, "")


def _check_nested_configs(config: dict, model_type: str, where: str) -> None:
    """A key transformers reads as a nested config must be one of the family's sub-configs (asked
    of transformers only when such a key is set, which few configs do)."""
    present = [key for key in NESTED_CONFIG_KEYS if config.get(key) is not None]
    if not present:
        return
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return  # refused by name where the family is looked up
    own = getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}
    for key in present:
        if key not in own:
            raise NormswapError(f"{where}: a {model_type} config has no '{key}' (got {_show(config[key])}); "
                                "transformers would read it as a nested config")


def _check_values(config: dict, where: str, prefix: str) -> None:
    for key in POSITIVE_INTS:
        value = config.get(key)
        if value is not None and not _positive_int(value):
            raise NormswapError(f"{where}: '{prefix}{key}' must be a positive integer (got {_show(value)})")
    for key in POSITIVE_INT_OR_PAIR:
        value = config.get(key)
        pair = isinstance(value, list) and len(value) == 2 and all(_positive_int(item) for item in value)
        if value is not None and not (_positive_int(value) or pair):
            raise NormswapError(f"{where}: '{prefix}{key}' must be a positive integer or a pair of them "
                                f"(got {_show(value)})")
    labels = config.get("num_labels")
    if labels is not None and not (_natural(labels) and labels <= MAX_LABELS):
        raise NormswapError(f"{where}: '{prefix}num_labels' must be an integer from 0 to {MAX_LABELS} "
                            f"(got {_show(labels)})")
    for key in EPSILONS:
        value = config.get(key)
        if value is not None and not (_number(value) and math.isfinite(value) and value >= 0):
            raise NormswapError(f"{where}: '{prefix}{key}' must be a non-negative number (got {_show(value)})")
    for key in BOOLEANS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise NormswapError(f"{where}: '{prefix}{key}' must be true or false (got {_show(value)})")
    for key in ACTIVATIONS:
        value = config.get(key)
        if value is not None and not _known_activation(value):
            raise NormswapError(f"{where}: '{prefix}{key}' names no activation transformers knows (got {_show(value)})")
    if config.get("head_dim") is None:
        for width, heads in DIVISIBLE:
            if isinstance(config.get(width), int) and isinstance(config.get(heads), int):
                if config[width] % config[heads]:
                    raise NormswapError(f"{where}: '{prefix}{width}' = {config[width]} is not divisible by "
                                        f"'{prefix}{heads}' = {config[heads]}")
    _check_rotary(config, where, prefix)
    for key in SUB_CONFIGS:
        sub = config.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise NormswapError(f"{where}: '{prefix}{key}' must be a mapping (got {_show(sub)})")
        _check_values(sub, where, f"{prefix}{key}.")


def _check_rotary(config: dict, where: str, prefix: str) -> None:
    """Rotary positions turn pairs of a head's coordinates: the turned part (``rotary_dim``, or the
    head dimension times a fraction) must be even and fit in the head, or the model's first
    forward fails on mismatched shapes."""
    head = _head_dim(config)
    fractions = [(f"{prefix}{key}", config.get(key)) for key in ROTARY_FRACTIONS]
    fractions += [(f"{prefix}{block}.{key}", config[block].get(key)) for block in ROPE_BLOCKS
                  if isinstance(config.get(block), dict) for key in ROTARY_FRACTIONS]
    turned = []
    for key, value in fractions:
        if value is not None and not (_number(value) and 0 <= value <= 1):
            raise NormswapError(f"{where}: '{key}' must be a number from 0 to 1 (got {_show(value)})")
        if value is not None and head is not None:
            turned.append((key, int(head * value), f" ({head} x {value:g})"))
    rotary_dim = config.get("rotary_dim")
    if _positive_int(rotary_dim) and head is not None and rotary_dim > head:
        raise NormswapError(f"{where}: '{prefix}rotary_dim' = {rotary_dim} exceeds the head dimension {head}")
    if _positive_int(rotary_dim):
        turned.append((f"{prefix}rotary_dim", rotary_dim, ""))
    for key, size, how in turned:
        if size % 2:
            raise NormswapError(f"{where}: '{key}' gives {size} rotary coordinates per head{how}, an odd "
                                "number; rotary positions turn coordinates in pairs")


def _head_dim(config: dict) -> int | None:
    if _positive_int(config.get("head_dim")):
        return config["head_dim"]
    width = next((config[key] for key in WIDTHS if _positive_int(config.get(key))), None)
    heads = next((config[key] for key in HEAD_COUNTS if _positive_int(config.get(key))), None)
    return width // heads if width and heads else None


def check_layer_count(config: dict, tensor_names: Iterable[str], where: str) -> None:
    """Refuse a config whose layer count disagrees with the blocks present in the weights.

    The deepest stack's count (``n_layer``, ``encoder_layers``, ...; sub-configs included) must
    equal the number of blocks the tensor names index (the largest block index plus one).
    """
    counts = [(f"{prefix}{key}", value) for prefix, sub in _configs(config) for key in LAYER_COUNTS
              if isinstance((value := sub.get(key)), int)]
    indices = [int(match.group(1)) for name in tensor_names if (match := _BLOCK_INDEX.search(name))]
    if not counts or not indices:
        return
    key, claimed = max(counts, key=lambda item: item[1])
    present = max(indices) + 1
    if claimed != present:
        raise NormswapError(f"{where}: '{key}' = {claimed}, but the weights hold {present} layer"
                            f"{'s' if present != 1 else ''}")


# the type of each key of a converted config's ``normswap`` block, and how a message names it
PROVENANCE_KEYS: dict[str, type] = {
    "version": str, "source": str, "original_model_type": str, "auto_class": str, "modeling_sha256": str,
    "options": dict, "structure": dict, "norms_swapped": list, "norms_folded": list, "untied": list,
    "stock_loadable": bool, "writers_centred": int, "rotated_from": str, "rotated_from_source": str,
}
_TYPE_WORDS = {str: "a string", dict: "a mapping", list: "a list", bool: "true or false", int: "a number"}


def check_structure(path: Path, config: dict) -> None:
    """The config's own checks and its layer count against the weight headers (no tensor is read)."""
    where = f"{path / 'config.json'}"
    check_config(config, where)

    with CheckpointReader(path) as reader:
        check_layer_count(config, reader.tensors, where)


def check_provenance(block: object, path: Path) -> None:
    """Refuse a malformed ``normswap`` block in one line naming the key."""
    where = f"{path / 'config.json'}: the normswap block"
    if not isinstance(block, dict):
        raise NormswapError(f"{where} is not a mapping")
    for key, kind in PROVENANCE_KEYS.items():
        if key in block and not isinstance(block[key], kind):
            raise NormswapError(f"{where}: '{key}' must be {_TYPE_WORDS[kind]} (got {block[key]!r:.60})")
    options = block.get("options", {})
    if options.get("method", "exact") not in ("exact", "naive"):
        raise NormswapError(f"{where}: options.method must be exact or naive (got {options.get('method')!r:.60})")
    dtype = options.get("dtype")

    if dtype is not None and dtype not in DTYPE_NAMES:
        raise NormswapError(f"{where}: options.dtype {dtype!r:.60} is not a dtype normswap writes")
    for kind, paths in block.get("structure", {}).items():
        if not isinstance(paths, list) or not all(isinstance(item, str) for item in paths):
            raise NormswapError(f"{where}: structure.{kind} must be a list of module names")


def _configs(config: dict) -> list[tuple[str, dict]]:
    found = [("", config)]
    for key in SUB_CONFIGS:
        if isinstance(config.get(key), dict):
            found.append((f"{key}.", config[key]))
    return found


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# activation names transformers knows (transformers.activations.ACT2CLS; a test keeps them a
# subset): checked without importing transformers, which is asked only about other names
COMMON_ACTIVATIONS = frozenset({"gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "quick_gelu", "relu", "silu",
                                "swish", "tanh", "sigmoid", "linear"})


def _known_activation(value: object) -> bool:
    if not isinstance(value, str):
        return False
    if value in COMMON_ACTIVATIONS:
        return True
    from transformers.activations import ACT2CLS

    return value in ACT2CLS


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# config keys that conversion and rotation never change: they must agree between the two models
_SHAPE_KEYS = ("vocab_size", "n_embd", "hidden_size", "d_model", "n_layer", "num_hidden_layers", "n_head",
               "num_attention_heads", "n_inner", "intermediate_size", "encoder_layers", "decoder_layers")


def check_same_shape(original_dir: Path, original: dict, converted_dir: Path, converted: dict) -> None:
    """Refuse, before any model is built, two checkpoints of different shapes: the converted one
    cannot have been made from the original."""
    for key in _SHAPE_KEYS:
        if key in original and key in converted and original[key] != converted[key]:
            raise NormswapError(f"{converted_dir} was not converted from {original_dir}: {key} is "
                                f"{converted[key]!r:.20} there and {original[key]!r:.20} here")
