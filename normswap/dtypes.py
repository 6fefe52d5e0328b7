"""Floating dtypes by the names users type (``--dtype bf16``) and the names normswap records.

Names are checked without importing torch, so a recipe or an option with a typo is refused before
any heavy import.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from normswap.errors import NormswapError

if TYPE_CHECKING:
    import torch

# every accepted spelling → the name config.json and provenance record
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "float64": "float64", "fp64": "float64",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
}


def canonical_name(name: str) -> str:
    """``bf16`` → ``bfloat16`` (case ignored); one line naming the choices for anything else."""
    canonical = DTYPE_NAMES.get(str(name).lower())
    if canonical is None:
        raise NormswapError(f"unknown dtype '{name}'; use one of {', '.join(DTYPE_NAMES)}")
    return canonical


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """The ``torch.dtype`` for a name (case ignored); None is returned as it is, and a
    ``torch.dtype`` too when it is one of the floating dtypes named in ``DTYPE_NAMES`` (any other,
    ``torch.int8`` or ``torch.complex64``, is refused as its name is)."""
    if name is None:
        return None
    import torch

    if isinstance(name, torch.dtype):
        if dtype_name(name) not in DTYPE_NAMES.values():
            raise NormswapError(f"dtype {name} is not one normswap computes or stores in; use one of "
                                f"{', '.join(DTYPE_NAMES)}")
        return name
    return getattr(torch, canonical_name(name))


def dtype_name(dtype: torch.dtype | str) -> str:
    """The name config.json and provenance record: ``float32``, ``bfloat16``, ... (a name is
    returned as it is)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


# (atol, rtol) of verification for a checkpoint stored in each dtype
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-4, 1e-5),  # verification computes in float32 whatever the weights
    "float32": (1e-4, 1e-5),
    "float16": (2e-2, 2e-3),
    "bfloat16": (1e-1, 1e-2),
}


def default_tolerance(dtype: torch.dtype | str) -> tuple[float, float]:
    """(atol, rtol) for a checkpoint stored in ``dtype``."""
    return DEFAULT_TOLERANCES.get(dtype_name(dtype), DEFAULT_TOLERANCES["float32"])


def least_precise(dtypes: set[str]) -> str:
    """The floating dtype (by name) whose default tolerance is widest: a checkpoint mixing
    float16 and float32 tensors is as exact as its float16 ones; ``float32`` for none."""
    return max(sorted(dtypes), key=lambda name: default_tolerance(name), default="float32")


# bytes per element of every dtype a checkpoint may hold, by torch's name for it
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or its name), without importing torch."""
    return dtype.itemsize if not isinstance(dtype, str) else ITEMSIZE[dtype]


def is_floating(dtype: torch.dtype | str) -> bool:
    """Whether ``dtype`` (a ``torch.dtype`` or its name) is a floating-point type."""
    return dtype.is_floating_point if not isinstance(dtype, str) else dtype.startswith(("float", "bfloat"))


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (``float32``); imports torch."""
    import torch

    return getattr(torch, name)


# the policy on what a checkpoint's tensors may be, checked as each weight file's header is read
WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")
BUFFER_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64")
# the integer and boolean tensors checkpoints carry: causal masks, position ids, rotary tables
_BUFFER_NAME = re.compile(r"(?:^|\.)(?:masked_bias|causal_mask|position_ids|inv_freq|(?:attn|attention|transformer)\.bias)$")


def check_tensor_dtype(name: str, dtype: str, where: str) -> None:
    """Refuse, naming the tensor and its dtype, a tensor a LayerNorm checkpoint cannot hold.

    Weights are float16, bfloat16, float32 or float64 (conversion computes in float64 and writes
    a floating dtype). Integer and boolean tensors are accepted only as the buffers named above;
    float8 is a quantised storage format, refused like every other dtype (complex, quantised).
    """
    if dtype in WEIGHT_DTYPES or (dtype in BUFFER_DTYPES and _BUFFER_NAME.search(name)):
        return
    if dtype.startswith("float8") or dtype.startswith("q") or dtype.startswith("float4"):
        why = "quantised weights are not converted; dequantise the checkpoint to float16, bfloat16 or float32 first"
    elif dtype in BUFFER_DTYPES:
        why = "a LayerNorm model's weights are floating point (float16, bfloat16, float32 or float64)"
    else:
        why = "normswap reads dense float16, bfloat16, float32 and float64 weights"
    raise NormswapError(f"{where}: tensor {name} has dtype {dtype}; {why}")
