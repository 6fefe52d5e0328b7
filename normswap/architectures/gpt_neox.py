"""GPT-NeoX / Pythia: separate input and post-attention norms, rotary positions, untied head.

With ``use_parallel_residual`` the block is x + attn(ln_in(x)) + mlp(ln_post(x)); without it,
y = x + attn(ln_in(x)) and y + mlp(ln_post(y)). Either way each norm reads the stream and has
one reader (``query_key_value`` and ``dense_h_to_4h``), and the writers are the token table,
``attention.dense`` and ``mlp.dense_4h_to_h``: one adapter covers both. Checkpoints name the
head ``embed_out``; transformers renames it to ``lm_head`` on load and the plan does the same.
With ``attention_bias=False`` the input norm keeps β/γ (``query_key_value`` has no bias slot).
"""

from normswap.architectures.spec import Architecture, Norm, Writer, linear_reader, linear_writers, pattern

H = "gpt_neox.layers.{layer}"

GPT_NEOX = Architecture(
    model_types=("gpt_neox",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("gpt_neox.embed_in.weight", hidden_axis=1),
        *linear_writers(H + ".{attention.dense|mlp.dense_4h_to_h}"),
    ),
    norms=(
        Norm(H + ".input_layernorm", (linear_reader(H + ".attention.query_key_value"),)),
        Norm(H + ".post_attention_layernorm", (linear_reader(H + ".mlp.dense_h_to_4h"),)),
        Norm("gpt_neox.final_layer_norm", (linear_reader("lm_head", bias=False),)),
    ),
    tied=(("lm_head.weight", "gpt_neox.embed_in.weight"),),
    blocks="gpt_neox.layers",
    ignore=(pattern(H + ".attention.{bias|masked_bias|rotary_emb.inv_freq}"),),
)
