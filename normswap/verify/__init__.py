"""Verification: run the original and the converted checkpoint on the same probe and compare.

- ``checkpoint``: ``verify_checkpoint``, the entry point: checks the pair, proves the weights, then
  compares whole models or block by block.
- ``rotated``: ``verify_rotated``, the same for a rotated checkpoint (its stream is C·h·Q).
- ``pairs``: what a checkpoint is verified against (its original, or the folded conversion a
  rotation was made from) and which outputs are compared.
- ``proof``: the algebraic proof of every stored tensor against the plan, before any model runs
  (block by block: beside the forward passes).
- ``probes``: the inputs both models run on.
- ``compare``: tolerances and the figures of a comparison.
- ``loaders``: the ways a converted checkpoint is loaded, and the loop over them.
- ``whole``: whole-model comparison.
- ``layerwise``: block-by-block comparison, for models that do not fit in memory twice
  (``offload``: models on meta whose weights are read from the checkpoint a unit at a time).
"""

from __future__ import annotations

from normswap.convert.install import check_tolerance

__all__ = ["check_tolerance"]
