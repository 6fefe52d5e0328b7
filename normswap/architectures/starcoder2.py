"""StarCoder2: Llama-style blocks with LayerNorms, biases (``use_bias``), rotary positions.

``input_layernorm`` is read by q/k/v_proj, ``post_attention_layernorm`` by ``mlp.c_fc``; the
writers are the token table, ``self_attn.o_proj`` and ``mlp.c_proj``. Keys are not marked
``constant_cancels``: rotary rotates a constant added to every key by position.
"""

from __future__ import annotations

from normswap.architectures.spec import assemble, embeddings, linear_reader, lm_head, pre_ln_blocks

STARCODER2 = assemble(
    "starcoder2", "AutoModelForCausalLM",
    embeddings("model.embed_tokens.weight"),
    pre_ln_blocks("model.layers", writes="{self_attn.o_proj|mlp.c_proj}",
                  input_layernorm=tuple(linear_reader(f"self_attn.{p}_proj") for p in "qkv"),
                  post_attention_layernorm=linear_reader("mlp.c_fc")),
    lm_head("model.norm", tied_to="model.embed_tokens.weight"),
    blocks="model.layers",
)
