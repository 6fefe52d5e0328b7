"""Rotation and slicing of the residual stream.

- ``matrices``: the rotation Q: randomised Hadamard, seeded orthogonal, or pca; stored and checked.
- ``commuting``: the same three with Q·1 = 1, which commute with LayerNorm itself (the default form).
- ``plan``: which sources rotate, and the rotation plan with its ``Rotate`` steps.
- ``online``: the online Hadamard at the MLP down projections (free form).
- ``calibration``: the stream's second moments on calibration inputs, measured block by block.
- ``pipeline``: ``rotate_checkpoint``: fold, plan, write, verify, install a rotated checkpoint.
- ``slicing``: SliceGPT's math: kept bases, shortcut matrices, the sliced tensors.
- ``slice_pipeline``: ``slice_checkpoint``: plan, write and measure a sliced checkpoint.
- ``quantise``: round-to-nearest fake quantisation, to measure what rotation buys.
"""
