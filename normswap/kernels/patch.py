"""Substitute normswap's RMSNorm kernels into a model already in memory.

``patch(model)`` does two things, both in place and both numerically transparent:

1. Every module whose class has ``is_normswap_rmsnorm = True`` (duck-typed: the copy of
   ``modeling/remote.py`` inside a checkpoint is a different class object) gets an instance-level
   ``forward`` calling ``normswap.kernels.rms_norm``: the Triton kernel on CUDA, the exact torch
   fallback elsewhere.
2. Blocks of a recognised upstream class (``fusion.FUSIONS``: GPT-2, GPT-BigCode, GPT-Neo, GPT-J,
   CodeGen, GPT-NeoX, OPT, Phi, Falcon; stock forward only, a subclass that overrides ``forward``
   is left alone) get a forward that fuses every residual add feeding a norm into that norm,
   including the block's last add, which feeds the next block's input norm (see ``fusion``).

A norm carrying forward hooks (``apply_structure``'s centring hooks) keeps its ``__call__`` path,
so the hooks still run; the fused block forward falls back to calling such a norm unfused.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from normswap.arguments import checked

from . import fusion
from .fusion import is_rmsnorm
from .ops.rms_norm import module_rms_norm

__all__ = ["is_rmsnorm", "patch", "unpatch"]


def _rmsnorm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm.forward through the kernels: same math, same rounding points; the output the
    block before computed for this very ``x``, if it did (``fusion.end_add``)."""
    if not torch.compiler.is_compiling() and self.__dict__.get(fusion._PENDING) is not None:
        y = fusion.take_pending(self, x)
        if y is not None:
            return y
    return module_rms_norm(self, x)


@checked
def patch(model: nn.Module) -> nn.Module:
    """Route ``model``'s normswap RMSNorms through the kernels and fuse residual adds; returns it.

    In place and idempotent; the state dict is untouched. Outputs equal the unpatched model's
    (bitwise with the CPU fallback; within float32 rounding of the statistics on CUDA).
    """
    fused: dict[nn.Module, fusion.BlockFusion] = {}
    for module in model.modules():
        if is_rmsnorm(module):
            # the kernels take one gain per channel: a per-head gain or a stored γ - 1 keeps its forward
            weight = getattr(module, "weight", None)
            if not getattr(module, "gain_offset", 0.0) and (weight is None or weight.dim() == 1):
                module.forward = types.MethodType(_rmsnorm_forward, module)
            continue
        found = fusion.fusion_for(module)
        if found is not None:
            module.forward = types.MethodType(found.forward, module)
            fused[module] = found
    fusion.link_handoffs(model, fused)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo ``patch``: drop the instance-level forwards and handoffs it set; returns ``model``."""
    patched = {_rmsnorm_forward} | {f.forward for f in fusion.FUSIONS}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ in patched:
            del module.forward
        module.__dict__.pop(fusion._NEXT, None)
        module.__dict__.pop(fusion._PENDING, None)
    return model
