"""Verification: run the original and the converted checkpoint on the same probe and compare.

- ``compare``: probes, tolerances and the figures of a comparison.
- ``layerwise``: the same comparison block by block, for models that do not fit in memory.
"""
