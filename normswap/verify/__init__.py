"""Verification: run the original and the converted checkpoint on the same probe and compare.

- ``checkpoint``: ``verify_checkpoint``, ``verify_conversion`` and ``verify_rotation``, the entry
  points: check the pair, prove the weights, then compare whole models or block by block.
- ``contents``: the folder holds what normswap writes, and nothing it does not.
- ``pairs``: what a checkpoint is verified against (its original, or the folded conversion a
  rotation was made from) and which outputs are compared.
- ``proof``: the algebraic proof of every stored tensor against the plan, before any model runs.
- ``probes``: the inputs both models run on.
- ``compare``: tolerances and the figures of a comparison.
- ``comparison``: ``Comparison``, what one forward comparison runs.
- ``whole``: whole-model comparison.
- ``layerwise``: block-by-block comparison, for models that do not fit in memory twice.
"""

from __future__ import annotations

from normswap.convert.install import check_tolerance

__all__ = ["check_tolerance"]
