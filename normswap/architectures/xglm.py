"""XGLM: a pre-LN decoder with scaled token embeddings and sinusoidal positions, tied head.

Writers: the token table (its scale √d commutes with centring), every ``self_attn.out_proj``
(and ``encoder_attn.out_proj`` when configured) and ``fc2``. The sinusoidal positions are a
buffer computed at run time, not a weight, so they cannot be centred: as in Whisper's encoder,
the RMSNorm class centres the first layer's input explicitly (``centre_input``). The stock class
needs no such step: every LayerNorm removes the positions' per-token mean.
"""

from __future__ import annotations

from normswap.architectures.layouts import bart_blocks
from normswap.architectures.spec import CENTRE_INPUT, assemble, embeddings, lm_head, pattern

XGLM = assemble(
    "xglm", "AutoModelForCausalLM",
    embeddings("model.embed_tokens.weight"),
    bart_blocks("model.layers", cross_attention=True),
    lm_head("model.layer_norm", tied_to="model.embed_tokens.weight"),
    # the stream starts as E[token] + sinusoid(position): centre it once, explicitly
    structure=lambda config: {CENTRE_INPUT: [pattern("model.layers.0")]},
    blocks="model.layers",
)
