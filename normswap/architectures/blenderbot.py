"""Blenderbot: a pre-LN encoder-decoder with learned positions (see seq2seq.py).

``BlenderbotEncoderLayer.forward`` applies ``self_attn_layer_norm`` before attention and adds
the residual after it: pre-LN. Its position tables are writers, centred like the token table;
it has no norm on the embeddings.
"""

from __future__ import annotations

from normswap.architectures.seq2seq import encoder_decoder

BLENDERBOT = encoder_decoder("blenderbot", "BlenderbotForConditionalGeneration", learned_positions=True,
                             embedding_norm=False)
