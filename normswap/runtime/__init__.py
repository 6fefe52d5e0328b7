"""Running a checkpoint as a model: the loaders, the block-by-block offload runner, and the
reference-model and tokenizer helpers that verification, calibration and evaluation share.

- ``checkpoint``: ``Checkpoint``, a source folder opened once: config, reader, adapter, provenance.
- ``loaders``: the ways a converted checkpoint is loaded, and the loop over them.
- ``lockstep``: several loads run block by block in turn, sharing each weight read.
- ``offload``: models on meta whose weights are read from the checkpoint a unit at a time.
- ``reference``: reference models, the checkpoint's tokenizer and text turned into token ids.
- ``background``: work run beside the caller's, in a thread or a forked process.
"""
