"""StarCoder2: Llama-style blocks with LayerNorms, biases (``use_bias``), rotary positions.

``input_layernorm`` is read by q/k/v_proj, ``post_attention_layernorm`` by ``mlp.c_fc``; the
writers are the token table, ``self_attn.o_proj`` and ``mlp.c_proj``. Keys are not marked
``constant_cancels``: rotary rotates a constant added to every key by position.
"""

from __future__ import annotations

from normswap.architectures.layouts import llama_layout
from normswap.architectures.spec import assemble, attention_readers, linear_reader

STARCODER2 = assemble(
    "starcoder2", "AutoModelForCausalLM",
    llama_layout(writes="{self_attn.o_proj|mlp.c_proj}", input_layernorm=attention_readers("self_attn", rotary=True),
                 post_attention_layernorm=linear_reader("mlp.c_fc")),
    blocks="model.layers",
)
