"""Fused RMSNorm kernels (Triton on CUDA, an exact torch fallback elsewhere) and model patching.

``rms_norm`` is the op; ``patch(model)`` substitutes it into every normswap RMSNorm of a model
and fuses residual adds into the norms they feed; ``compile_for_generation(model)`` sets a model
up to generate with a static cache under ``torch.compile``.
"""

from .compiled import compile_for_generation
from .ops.rms_norm import HAS_TRITON, rms_norm, set_compile_path, use_kernels
from .patch import patch

__all__ = ["HAS_TRITON", "compile_for_generation", "patch", "rms_norm", "set_compile_path", "use_kernels"]
