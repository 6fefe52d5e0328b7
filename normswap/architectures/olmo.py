"""OLMo (v1): Llama-style blocks whose LayerNorms hold neither weight nor bias.

``OlmoLayerNorm`` is F.layer_norm without γ or β (eps 1e-5): with every write centred it is an
RMSNorm with no parameters, and there is nothing to fold. ``input_layernorm`` feeds the bias-free
q/k/v_proj, ``post_attention_layernorm`` the gated MLP; the writers are the token table,
``o_proj`` and ``down_proj``. ``clip_qkv`` clamps q/k/v outputs, which centring the stream (the
norms' outputs are unchanged) leaves unchanged.
"""

from __future__ import annotations

from normswap.architectures.spec import assemble, embeddings, linear_reader, lm_head, pre_ln_blocks

OLMO = assemble(
    "olmo", "AutoModelForCausalLM",
    embeddings("model.embed_tokens.weight"),
    pre_ln_blocks("model.layers", writes="{self_attn.o_proj|mlp.down_proj}",
                  input_layernorm=tuple(linear_reader(f"self_attn.{p}_proj", bias=False) for p in "qkv"),
                  post_attention_layernorm=tuple(linear_reader(f"mlp.{p}_proj", bias=False) for p in ("gate", "up"))),
    lm_head("model.norm", tied_to="model.embed_tokens.weight"),
    blocks="model.layers",
)
