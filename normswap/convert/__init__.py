"""Conversion, in the order it runs.

- ``source``: find a checkpoint (directory, bundled example or hub id: ``hub``) and read its tensors.
- ``safetensors_io``: the safetensors format: header parsing and checks, positioned reads, the
  pieces of the streaming writer.
- ``plan``: resolve an adapter against the checkpoint's names into per-tensor ``steps`` (data).
- ``fold``: the float64 tensor math, with its derivation, and the execution of the steps.
- ``write``: stream the planned tensors into safetensors shards.
- ``pipeline``: check → plan → write → verify → install, top to bottom (``write_checkpoint`` is
  shared with ``normswap.rotate.pipeline``).
"""
