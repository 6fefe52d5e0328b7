"""Names in a plan: checkpoint names to the model class's, structure patterns to module paths,
source shards to output shards."""

from __future__ import annotations

import re
from collections.abc import Callable

from normswap.convert.steps import Structure
from normswap.errors import NormswapError


def canonical_names(
    source_names: list[str], model_keys: set[str], base_prefix: str, rename: Callable[[str], str] | None = None
) -> dict[str, str]:
    """Map checkpoint names to the model class's names, adding the base-model prefix if missing.

    Hub GPT-2 stores ``h.0.ln_1.weight`` (saved from GPT2Model) where GPT2LMHeadModel expects
    ``transformer.h.0.ln_1.weight``. ``rename`` applies transformers' own load-time key renamings
    first (transformers 5 renames e.g. ViT's ``encoder.layer.0.attention.attention.query`` to
    ``layers.0.attention.q_proj``), so adapters only ever see the model class's names.
    """
    mapping = {}
    for name in source_names:
        renamed = rename(name) if rename is not None else name
        if renamed not in model_keys and name in model_keys:
            renamed = name
        prefixed = f"{base_prefix}.{renamed}" if base_prefix else renamed
        mapping[name] = prefixed if renamed not in model_keys and prefixed in model_keys else renamed
    return mapping


def resolve_structure(structure: dict[str, list[str]], module_names: list[str] | None) -> Structure:
    """Turn the adapter's structure patterns into module paths of the model class.

    Adapters give regular expressions (``(model\\.)?encoder\\.layers\\.0``) because one family's
    classes nest the same module under different prefixes. Each pattern must match at least one
    module: a structural change that silently applied nowhere would leave the model inexact.
    Without ``module_names`` the patterns are kept as they are.
    """
    if module_names is None:
        return Structure.from_json(structure)
    resolved: dict[str, list[str]] = {}
    for kind, patterns in structure.items():
        paths = []
        for pattern in patterns:
            matched = [name for name in module_names if name and re.fullmatch(pattern, name)]
            if not matched:
                raise NormswapError(f"structure '{kind}': no module of the model class matches '{pattern}'")
            paths.extend(name for name in matched if name not in paths)
        resolved[kind] = paths
    return Structure.from_json(resolved)


def output_shard_names(source_shards: list[str]) -> dict[str, str]:
    """Output shard for each source shard, named as transformers names them."""
    if len(source_shards) == 1:
        return {source_shards[0]: "model.safetensors"}
    total = len(source_shards)
    return {shard: f"model-{i:05d}-of-{total:05d}.safetensors" for i, shard in enumerate(source_shards, 1)}
