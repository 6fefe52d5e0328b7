"""CTRL: a pre-LN decoder with scaled token embeddings and sinusoidal positions, a tied head with
its own bias.

Writers: the token table ``w`` (its scale √d commutes with centring; token-type ids read the
same table), every ``multi_head_attention.dense`` and ``ffn.2`` (the Sequential's second
Linear). ``layernorm1`` is read by ``Wq``/``Wk``/``Wv``, ``layernorm2`` by ``ffn.0``, the final
``layernorm`` by the head. The sinusoidal positions are a buffer computed at run time, not a
weight, so the RMSNorm class centres the first block's input explicitly (``centre_input``), as
for XGLM.
"""

from __future__ import annotations

from normswap.architectures.spec import (
    CENTRE_INPUT,
    assemble,
    embeddings,
    linear_reader,
    lm_head,
    pattern,
    pre_ln_blocks,
)

ATTENTION = "multi_head_attention"

CTRL = assemble(
    "ctrl", "AutoModelForCausalLM",
    embeddings("transformer.w.weight"),
    pre_ln_blocks("transformer.h", writes=f"{{{ATTENTION}.dense|ffn.2}}",
                  layernorm1=(linear_reader(f"{ATTENTION}.Wq"),
                              linear_reader(f"{ATTENTION}.Wk", constant_cancels=True),
                              linear_reader(f"{ATTENTION}.Wv")),
                  layernorm2=linear_reader("ffn.0")),
    lm_head("transformer.layernorm", bias=True, tied_to="transformer.w.weight"),
    # the stream starts as √d·E[token] + sinusoid(position): centre it once, explicitly
    structure=lambda config: {CENTRE_INPUT: [pattern("transformer.h.0")]},
    blocks="transformer.h",
)
