"""mBART: a pre-LN encoder-decoder with learned positions and a LayerNorm on the embeddings.

``MBartEncoderLayer.forward`` applies ``self_attn_layer_norm`` before attention and adds the
residual after it: pre-LN, unlike BART. See seq2seq.py for the wiring.
"""

from __future__ import annotations

from normswap.architectures.seq2seq import encoder_decoder

MBART = encoder_decoder("mbart", "MBartForConditionalGeneration", learned_positions=True, embedding_norm=True)
