"""Plan steps for two writer/reader forms: LayerScale on a writer's output, and per-head q/k norms.

Both act on tensors the generic plan already knows: a LayerScale's λ folds into the writer it
scales before that writer is centred; a per-head norm's projection is centred head by head after
any bias fold (which adds Wβ to the projection's bias). The math is in ``normswap.convert.fold``.
"""

from __future__ import annotations

import re

from normswap.architectures.spec import Architecture, format_template, pattern
from normswap.convert.steps import CentreHeads, Fill, FoldGain, NormPlan, TensorPlan
from normswap.errors import NormswapError


def fold_layer_scales(architecture: Architecture, plans: dict[str, TensorPlan]) -> None:
    """λ ⊙ (W·u + b) = (diag(λ)·W)·u + λ ⊙ b: fold each LayerScale into its writer; λ becomes 1."""
    for scale in architecture.layer_scales:
        for name in [name for name in plans if re.fullmatch(pattern(scale.scale), name)]:
            groups = re.fullmatch(pattern(scale.scale), name).groupdict()
            writer = format_template(scale.writer).format(**groups)
            for suffix in (".weight", ".bias"):
                if writer + suffix in plans:
                    plans[writer + suffix].steps.append(FoldGain(plans[name].source, axis=0))
            plans[name].steps.append(Fill(1.0))


def centre_heads(architecture: Architecture, plans: dict[str, TensorPlan], norms: list[NormPlan]) -> None:
    """Centre each head's rows of the projections that per-head norms read (``fold.centre_heads``)."""
    centred = set()
    for norm in norms:
        spec = next((head for head in architecture.head_norms if re.fullmatch(head.pattern, norm.name)), None)
        if spec is None:
            continue
        gain = plans.get(norm.name + ".weight")
        if gain is None:
            raise NormswapError(f"per-head norm {norm.name} has no gain to give its head size")
        groups = re.fullmatch(spec.pattern, norm.name).groupdict()
        projection = format_template(spec.projection).format(**groups)
        for name in (projection + ".weight", projection + ".bias"):
            # the norms of one ModuleList (one per head) share a projection: centre it once
            if name in plans and (name, spec) not in centred:
                plans[name].steps.append(CentreHeads(spec.axis, gain.shape[-1], spec.period, spec.members))
                centred.add((name, spec))
        if (projection + ".weight", spec) not in centred:
            raise NormswapError(f"per-head norm {norm.name} should read {projection}, which the checkpoint lacks")
