"""Fused RMSNorm kernels (Triton on CUDA, an exact torch fallback elsewhere) and model patching.

- ``ops``: the RMSNorm op (``rms_norm``), its launcher, kernels and fallback.
- ``patch``: ``patch(model)`` substitutes the op into every normswap RMSNorm of a model.
- ``fusion``: residual adds fused into the norms they feed, per upstream block class.
- ``compiled``: ``compile_for_generation(model)``, generation with a static cache under ``torch.compile``.
- ``aot_check``: every kernel variant compiled for a GPU without one.
- ``testing``: the kernels in Triton's CPU interpreter, for tests without CUDA.
"""

from .compiled import compile_for_generation
from .ops.rms_norm import HAS_TRITON, rms_norm, set_compile_path, use_kernels
from .patch import patch

__all__ = ["HAS_TRITON", "compile_for_generation", "patch", "rms_norm", "set_compile_path", "use_kernels"]
