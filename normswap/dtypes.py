"""Floating dtypes by the names users type (``--dtype bf16``) and the names normswap records."""

from __future__ import annotations

import torch

from normswap.errors import NormswapError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """The ``torch.dtype`` for a name (case ignored); a dtype or None is returned as it is."""
    if name is None or isinstance(name, torch.dtype):
        return name
    dtype = DTYPES.get(str(name).lower())
    if dtype is None:
        raise NormswapError(f"unknown dtype '{name}'; use one of {', '.join(DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name config.json and provenance record: ``float32``, ``bfloat16``, ..."""
    return str(dtype).removeprefix("torch.")
