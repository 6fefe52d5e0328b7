"""M2M100 and NLLB: a pre-LN encoder-decoder with sinusoidal positions (see seq2seq.py)."""

from __future__ import annotations

from normswap.architectures.seq2seq import encoder_decoder

M2M_100 = encoder_decoder("m2m_100", "M2M100ForConditionalGeneration", learned_positions=False,
                          embedding_norm=False)
