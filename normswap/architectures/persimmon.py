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

from normswap.architectures.spec import HeadNorm, assemble, embeddings, linear_reader, lm_head, pre_ln_blocks

H = "model.layers.{layer}"

PERSIMMON = assemble(
    "persimmon", "AutoModelForCausalLM",
    embeddings("model.embed_tokens.weight"),
    pre_ln_blocks("model.layers", writes="{self_attn.dense|mlp.dense_4h_to_h}",
                  input_layernorm=linear_reader("self_attn.query_key_value"),
                  post_attention_layernorm=linear_reader("mlp.dense_h_to_4h")),
    lm_head("model.final_layernorm", tied_to="model.embed_tokens.weight"),
    head_norms=(HeadNorm(H + ".self_attn.q_layernorm", H + ".self_attn.query_key_value", period=3, members=(0,)),
                HeadNorm(H + ".self_attn.k_layernorm", H + ".self_attn.query_key_value", period=3, members=(1,))),
    blocks="model.layers",
)
