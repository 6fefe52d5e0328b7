"""Persimmon: pre-LN blocks with a fused ``query_key_value``, per-head q/k LayerNorms, rotary.

``input_layernorm`` is read by ``self_attn.query_key_value``, ``post_attention_layernorm`` by
``mlp.dense_h_to_4h``; the writers are the token table, ``self_attn.dense`` and
``mlp.dense_4h_to_h``; ``final_layernorm`` feeds the bias-free ``lm_head``.

``qk_layernorm``: one LayerNorm over ``head_dim`` applied to every head's query (and one to every
key). The fused projection's output is laid out [heads, 3, head_dim] (q, k, v per head), so each
head's q block (position 0 of 3) and k block (position 1) is centred, v is left alone: the
norms' inputs are then zero-mean and they become RMSNorms exactly (``HeadNorm``).
"""

from __future__ import annotations

from normswap.architectures.layouts import llama_layout, megatron_block
from normswap.architectures.spec import HeadNorm, assemble

H = "model.layers.{layer}"

PERSIMMON = assemble(
    "persimmon", "AutoModelForCausalLM",
    llama_layout(final_norm="model.final_layernorm", **megatron_block("self_attn")),
    head_norms=(HeadNorm(H + ".self_attn.q_layernorm", H + ".self_attn.query_key_value", period=3, members=(0,)),
                HeadNorm(H + ".self_attn.k_layernorm", H + ".self_attn.query_key_value", period=3, members=(1,))),
    blocks="model.layers",
)
