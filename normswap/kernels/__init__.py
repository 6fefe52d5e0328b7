"""Fused RMSNorm kernels (Triton on CUDA, an exact torch fallback elsewhere) and model patching.

``rms_norm`` is the op; ``patch(model)`` substitutes it into every normswap RMSNorm of a model
and fuses residual adds into the following norm where the block structure allows.
"""

from .ops.rms_norm import HAS_TRITON, rms_norm, use_kernels
from .patch import patch

__all__ = ["HAS_TRITON", "patch", "rms_norm", "use_kernels"]
