"""Running a checkpoint as a model: the loaders, the block-by-block offload runner, and the
reference-model and tokenizer helpers that verification, calibration and evaluation share.

- ``loaders``: the ways a converted checkpoint is loaded, and the loop over them.
- ``offload``: models on meta whose weights are read from the checkpoint a unit at a time.
- ``reference``: the checkpoint's tokenizer and text turned into token ids.
"""
