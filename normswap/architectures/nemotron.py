"""Nemotron: Llama-style blocks with ``LayerNorm1P``, a LayerNorm that stores γ - 1.

``NemotronLayerNorm1P`` computes F.layer_norm with weight + 1, so every norm is declared with
``gain_offset`` 1: folding reads γ as stored + 1 and leaves a stored 0 (a unit gain), and the
RMSNorm class computes with weight + 1 too (structure ``gain_plus_one``, which the plan adds).
``input_layernorm`` feeds q/k/v_proj, ``post_attention_layernorm`` the ungated MLP's ``up_proj``;
the writers are the token table, ``o_proj`` and ``mlp.down_proj``.
"""

from __future__ import annotations

from dataclasses import replace

from normswap.architectures.layouts import llama_layout
from normswap.architectures.spec import assemble, attention_readers, linear_reader

_NEMOTRON = assemble(
    "nemotron", "AutoModelForCausalLM",
    llama_layout(writes="{self_attn.o_proj|mlp.down_proj}", input_layernorm=attention_readers("self_attn", rotary=True),
                 post_attention_layernorm=linear_reader("mlp.up_proj")),
    blocks="model.layers",
)
NEMOTRON = replace(_NEMOTRON, norms=tuple(replace(norm, gain_offset=1.0) for norm in _NEMOTRON.norms))
