"""The ``.bin`` format: pickled state dicts, read with ``weights_only`` (no code runs) and checked
against the dtype policy (``normswap.dtypes.check_tensor_dtype``) as each shard is opened."""

from __future__ import annotations

import errno
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from normswap.dtypes import check_tensor_dtype, dtype_name
from normswap.errors import NormswapError, quoted

if TYPE_CHECKING:
    import torch


def load_pickle_shard(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict, memory-mapped, with no code run (``weights_only``)."""

    import torch

    try:
        with warnings.catch_warnings():  # torch's deprecation notes on old storages are not the user's business
            warnings.simplefilter("ignore")
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "zip" not in str(error).lower() and "mmap" not in str(error).lower():
                    raise
                # pickles from before torch 1.6 (not zip archives) cannot be mapped: load that shard whole
                state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        with open(file, "rb") as stream:  # torch.save writes a zip archive, or a pickle (protocol 2 and up)
            if stream.read(1) not in (b"P", b"\x80"):
                raise NormswapError(f"{file} is not a PyTorch weight file (neither a zip archive nor a pickle)") from None
        # torch's own message advises turning the safety off; normswap never does
        raise NormswapError(f"{file} holds Python objects other than tensors; normswap reads only tensors from "
                            ".bin files and runs no code from them") from None
    except (RuntimeError, EOFError) as error:
        # torch's own text goes on to paragraphs of advice; its first sentence says what failed
        reason = str(error).split(". ")[0] or type(error).__name__
        raise NormswapError(f"{file} is truncated or corrupt: {reason}") from None
    except OSError as error:
        if error.errno != errno.EINVAL:  # a file that cannot be opened keeps its OS error
            raise
        # the archive's directory points past the end of the file, so it cannot be mapped
        raise NormswapError(f"{file} is truncated or corrupt: it cannot be mapped ({error.strerror})") from None
    if not isinstance(state, dict):
        raise NormswapError(f"{file} does not hold a state dict")
    for name, value in state.items():
        if not isinstance(name, str):
            raise NormswapError(f"{file}: the key {quoted(name)} ({type(name).__name__}) is not a tensor name")
        if not isinstance(value, torch.Tensor):
            raise NormswapError(f"{file}: entry {quoted(name)} holds a {type(value).__name__}, not a tensor")
        check_tensor_dtype(name, _tensor_kind(value), str(file))
    return state


def _tensor_kind(tensor: torch.Tensor) -> str:
    """The dtype's name of a plain tensor; for any other kind (sparse, nested, quantised, on the
    meta device) a name the dtype policy refuses."""
    import torch

    if tensor.is_nested:
        return f"{dtype_name(tensor.dtype)} (a nested tensor)"
    if tensor.is_quantized:
        return dtype_name(tensor.dtype)
    if tensor.layout != torch.strided:
        return f"{dtype_name(tensor.dtype)} in {str(tensor.layout).removeprefix('torch.')} layout"
    if tensor.device.type == "meta":
        return f"{dtype_name(tensor.dtype)} on the meta device (no data)"
    return dtype_name(tensor.dtype)
