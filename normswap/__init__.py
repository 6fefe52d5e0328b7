"""normswap: exact LayerNorm → RMSNorm conversion of transformer checkpoints.

Public API:

- ``convert_checkpoint(src, out, ...)``: convert a checkpoint directory or hub id, write and verify.
- ``verify_checkpoint(original, converted)``: compare a converted checkpoint with its original.
- ``load(path)``: a converted checkpoint as an RMSNorm model using normswap's kernels.
- ``load_model(src)``: any checkpoint (original or converted) and its tokenizer, for evaluation.
- ``convert_model(model)``: convert a model already in memory.
- ``patch(model)``: substitute normswap's fused kernels into an RMSNorm model.
"""

__version__ = "0.1.0"

from normswap.errors import NormswapError, VerificationError  # noqa: E402
from normswap.loading import convert_model, load, load_model  # noqa: E402
from normswap.pipeline import convert_checkpoint, verify_checkpoint  # noqa: E402


def patch(model):
    """Substitute normswap's fused RMSNorm kernels into ``model`` (see ``normswap.kernels.patch``)."""
    from normswap.kernels.patch import patch as _patch

    return _patch(model)


__all__ = [
    "NormswapError",
    "VerificationError",
    "__version__",
    "convert_checkpoint",
    "convert_model",
    "load",
    "load_model",
    "patch",
    "verify_checkpoint",
]

from normswap.loading import register_auto_classes as _register_auto_classes  # noqa: E402

_register_auto_classes()
