"""Conversion, in the order it runs.

- ``planning``: the adapter and plan for a checkpoint, checked against its model class.
- ``names``: the adapter's structure patterns resolved to module paths.
- ``plan``: the adapter resolved against the checkpoint's names into per-tensor ``steps`` (data).
- ``steps``: the step kinds and the structure a conversion changes.
- ``heads``: plan steps for LayerScale on a writer and per-head q/k norms.
- ``fold``: the float64 tensor math, with its derivation, and the execution of the steps.
- ``write``: stream the planned tensors into safetensors shards, and the side files.
- ``card``: the converted config.json, provenance block and model card.
- ``install``: the one lifecycle: write → verify (passed in) → install.
- ``pipeline``: ``convert_checkpoint``: check → plan → install.
"""
