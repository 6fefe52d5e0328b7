"""Names in a plan: the adapter's structure patterns resolved to the model class's module paths.

Checkpoint tensor and shard names are ``normswap.checkpoint.names``'s."""

from __future__ import annotations

import re

from normswap.convert.steps import Structure
from normswap.errors import NormswapError


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
