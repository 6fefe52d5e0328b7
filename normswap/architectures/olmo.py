"""OLMo (v1): Llama-style blocks whose LayerNorms hold neither weight nor bias.

``OlmoLayerNorm`` is F.layer_norm without γ or β (eps 1e-5): with every write centred it is an
RMSNorm with no parameters, and there is nothing to fold. ``input_layernorm`` feeds the bias-free
q/k/v_proj, ``post_attention_layernorm`` the gated MLP; the writers are the token table,
``o_proj`` and ``down_proj``. ``clip_qkv`` clamps q/k/v outputs, which centring the stream (the
norms' outputs are unchanged) leaves unchanged.
"""

from __future__ import annotations

from normswap.architectures.layouts import gated_mlp_readers, llama_layout
from normswap.architectures.spec import assemble, attention_readers

OLMO = assemble(
    "olmo", "AutoModelForCausalLM",
    llama_layout(writes="{self_attn.o_proj|mlp.down_proj}",
                 input_layernorm=attention_readers("self_attn", bias=False, rotary=True),
                 post_attention_layernorm=gated_mlp_readers("mlp")),
    blocks="model.layers",
)
