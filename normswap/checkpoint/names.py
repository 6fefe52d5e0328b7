"""Names of a checkpoint's files and tensors: checkpoint names to the model class's, and shard
file names as transformers writes them. Pure name logic, used by every layer that reads or
writes a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Callable

# Q, stored beside a rotated checkpoint's weights in the safetensors format, under a name no weight
# loader globs (``*.safetensors``, ``*.bin``), so that no tool takes it for a shard
ROTATION_FILE = "normswap_rotation.record"

# a module-list index inside a dotted name: the 3 of ``transformer.h.3.attn``
_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def canonical_names(
    source_names: list[str], model_keys: set[str], base_prefix: str, rename: Callable[[str], str] | None = None
) -> dict[str, str]:
    """Map checkpoint names to the model class's names, adding the base-model prefix if missing.

    Hub GPT-2 stores ``h.0.ln_1.weight`` (saved from GPT2Model) where GPT2LMHeadModel expects
    ``transformer.h.0.ln_1.weight``. ``rename`` applies transformers' own load-time key renamings
    first (transformers 5 renames e.g. ViT's ``encoder.layer.0.attention.attention.query`` to
    ``layers.0.attention.q_proj``), so adapters only ever see the model class's names. A name
    the class already has is kept, and ``rename`` is not called for it: the renamings map older
    checkpoints' names onto the class's, whose own names load as they are. So is a name of the
    class's own form in a block the model was built without: a model of its first blocks only
    keeps ``transformer.h.47.attn.c_attn.weight``, the name block 47 has in the class.
    """
    own_forms = {_INDEX.sub("#", key) for key in model_keys}
    mapping = {}
    for name in source_names:
        if name in model_keys or _INDEX.sub("#", name) in own_forms:
            mapping[name] = name
            continue
        renamed = rename(name) if rename is not None else name
        prefixed = f"{base_prefix}.{renamed}" if base_prefix else renamed
        mapping[name] = prefixed if renamed not in model_keys and prefixed in model_keys else renamed
    return mapping


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` safetensors shards, as transformers names them."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def output_shard_names(source_shards: list[str]) -> dict[str, str]:
    """Output shard for each source shard, named as transformers names them."""
    return dict(zip(source_shards, shard_names(len(source_shards)), strict=True))
