"""Pegasus: a pre-LN encoder-decoder with sinusoidal positions (see seq2seq.py).

``PegasusEncoderLayer.forward`` applies ``self_attn_layer_norm`` before attention and adds the
residual after it: pre-LN. Its frozen sinusoid table is not centred: the RMSNorm class centres
each stack's first-layer input instead.
"""

from __future__ import annotations

from normswap.architectures.seq2seq import encoder_decoder

PEGASUS = encoder_decoder("pegasus", "PegasusForConditionalGeneration", learned_positions=False,
                          embedding_norm=False)
