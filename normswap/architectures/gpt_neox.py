"""GPT-NeoX / Pythia: separate input and post-attention norms, rotary positions, untied head.

With ``use_parallel_residual`` the block is x + attn(ln_in(x)) + mlp(ln_post(x)); without it,
y = x + attn(ln_in(x)) and y + mlp(ln_post(y)). Either way each norm reads the stream and has
one reader (``query_key_value`` and ``dense_h_to_4h``), and the writers are the token table,
``attention.dense`` and ``mlp.dense_4h_to_h``: one adapter covers both. Checkpoints name the
head ``embed_out``; transformers renames it to ``lm_head`` on load and the plan does the same.
With ``attention_bias=False`` the input norm keeps β/γ (``query_key_value`` has no bias slot).
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

H = r"gpt_neox\.layers\.(?P<layer>\d+)"
L = "gpt_neox.layers.{layer}"

GPT_NEOX = Architecture(
    model_types=("gpt_neox",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"gpt_neox\.embed_in\.weight", hidden_axis=1),
        Writer(H + r"\.(attention\.dense|mlp\.dense_4h_to_h)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(attention\.dense|mlp\.dense_4h_to_h)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.input_layernorm", (
            Reader(f"{L}.attention.query_key_value.weight", LINEAR_IN_AXIS, f"{L}.attention.query_key_value.bias"),
        )),
        Norm(H + r"\.post_attention_layernorm", (
            Reader(f"{L}.mlp.dense_h_to_4h.weight", LINEAR_IN_AXIS, f"{L}.mlp.dense_h_to_4h.bias"),
        )),
        Norm(r"gpt_neox\.final_layer_norm", (Reader("lm_head.weight", LINEAR_IN_AXIS),)),
    ),
    tied=(("lm_head.weight", "gpt_neox.embed_in.weight"),),
    blocks="gpt_neox.layers",
    ignore=(H + r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",),
)
