"""The online Hadamard at the MLP down projections (QuaRot's), an option of the free form.

A residual rotation never reaches the input of an MLP's down projection (GPT-2's ``mlp.c_proj``,
OPT's ``fc2``, ...): it is the MLP's hidden activation, after the non-linearity, where activation
outliers are worst. QuaRot turns it at run time: with H the orthonormal Hadamard matrix of the
down projection's input size n (``normswap.modeling.hadamard``, every order it builds, 3072 =
2⁸·12 included) and row vectors,

    y = x·W = (x·H)·(Hᵀ·W)            (Conv1D W [n, d]; nn.Linear stores Wᵀ [d, n] → Wᵀ·H)

so the stored weight is Hᵀ·W, H contracted along its input axis as ``fold.rotate_axis`` contracts
Q (here by the structured transform), and the model applies x ← x·H to that input before the layer (``modeling.remote
.apply_online_hadamard``, by ``hadamard_transform``: butterflies and one small product, never the
n×n matrix). The function is unchanged exactly. Nothing else can hold H: the input follows the
non-linearity, and no weight before it can turn GELU(z) into GELU(z)·H. So the stock class cannot
compute such a checkpoint, and the option is refused in the commuting form.

``config.normswap.rotation.online_hadamard`` records the model's module paths, n, the split
H = H₂^⊗k ⊗ F (``hadamard.kronecker_split``) with F's rows spelt in ``+``/``-`` (the checkpoint's
own modeling file rebuilds H from them), and the construction's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.architectures import Architecture
from normswap.convert.plan import ConversionPlan
from normswap.errors import NormswapError
from normswap.modeling import hadamard
from normswap.modeling.online import (
    MAX_FACTOR,
    check_record,
    down_projection_modules,
    is_down_projection,
    spec_for,
)
from normswap.modeling.remote import hadamard_transform


@dataclass(frozen=True, eq=False)
class OnlineHadamard:
    """A whole-tensor step: contract ``axis`` (the down projection's input) with H/√n, by the
    structured transform (``hadamard_transform``, the model's own at run time)."""

    axis: int
    twos: int
    factor: torch.Tensor = field(repr=False)
    slice_wise: bool = False

    def whole(self, value: torch.Tensor, read: object) -> torch.Tensor:
        moved = torch.movedim(value.double(), self.axis, -1).contiguous()
        return torch.movedim(hadamard_transform(moved, self.factor.double(), self.twos), -1, self.axis)


def add_online_hadamard(plan: ConversionPlan, architecture: Architecture, meta: nn.Module) -> dict:
    """Append the ``OnlineHadamard`` step to every down projection's weight (its input axis, the
    one that is not the writer's hidden axis); the provenance record. Refused in one line where
    the model has no down projection or no Hadamard matrix of its input size is built here."""
    weights = {}
    for name, tensor in plan.tensors.items():
        writer = next((w for w in architecture.writers if re.fullmatch(w.pattern, name)), None)
        if writer is not None and name.endswith(".weight") and is_down_projection(name.removesuffix(".weight")):
            weights[name] = (len(tensor.shape) - 1 - writer.hidden_axis, tensor)
    modules = down_projection_modules(meta)
    if not weights or len(weights) != len(modules):
        raise NormswapError(f"--online-hadamard: {architecture.model_types[0]} has no MLP down projection normswap "
                            "recognises (mlp.c_proj, fc2, fc_out, dense_4h_to_h, down_proj)")
    sizes = {tensor.shape[axis] for axis, tensor in weights.values()}
    if len(sizes) != 1:
        raise NormswapError(f"--online-hadamard: the down projections' input sizes differ ({sorted(sizes)})")
    size = sizes.pop()
    if hadamard.construction(size) is None:
        raise NormswapError(f"--online-hadamard: no Hadamard matrix of order {size} (the MLP's inner size) is "
                            "constructible here (Sylvester, prime-order Paley and their Kronecker products)")
    twos, factor = hadamard.kronecker_split(size)
    if factor.shape[0] > MAX_FACTOR:
        raise NormswapError(f"--online-hadamard: the Hadamard matrix of order {size} (the MLP's inner size) is "
                            f"{hadamard.describe(size)}, whose factor of order {factor.shape[0]} is over the "
                            f"{MAX_FACTOR} that config.json spells out for the model's own code")
    spec = spec_for(modules, size)
    for axis, tensor in weights.values():
        tensor.steps.append(OnlineHadamard(axis, twos, factor))
    return spec


def check_spec(spec: object, meta: nn.Module) -> None:
    """A recorded online Hadamard is the one normswap makes for this model (the proof's check, the
    loaders' own: ``modeling.online.check_record``)."""
    check_record(spec, meta)
