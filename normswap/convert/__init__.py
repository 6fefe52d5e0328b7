"""Conversion, in the order it runs.

- ``source``: find a checkpoint (directory, bundled example or hub id) and read its tensors.
- ``plan``: resolve an adapter against the checkpoint's names into per-tensor steps (data).
- ``fold``: the float64 tensor math each step applies, with its derivation.
- ``write``: stream the planned tensors into safetensors shards.
- ``pipeline``: convert → write → verify → install, top to bottom.
"""
