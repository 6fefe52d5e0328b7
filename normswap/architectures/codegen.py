"""CodeGen: GPT-J's parallel block with a fused ``qkv_proj``; rotary positions; head with a bias.

``ln_1`` is read by ``qkv_proj`` (no bias: β stays in the norm as β/γ) and ``fc_in``; the
writers are the token table, ``out_proj`` (no bias) and ``fc_out``. ``ln_f``'s β folds into the
``lm_head`` bias.
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

H = r"transformer\.h\.(?P<layer>\d+)"
L = "transformer.h.{layer}"

CODEGEN = Architecture(
    model_types=("codegen",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"transformer\.wte\.weight", hidden_axis=1),
        Writer(H + r"\.(attn\.out_proj|mlp\.fc_out)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(attn\.out_proj|mlp\.fc_out)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.ln_1", (
            Reader(f"{L}.attn.qkv_proj.weight", LINEAR_IN_AXIS),
            Reader(f"{L}.mlp.fc_in.weight", LINEAR_IN_AXIS, f"{L}.mlp.fc_in.bias"),
        )),
        Norm(r"transformer\.ln_f", (Reader("lm_head.weight", LINEAR_IN_AXIS, "lm_head.bias"),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    ignore=(H + r"\.attn\.(causal_mask|masked_bias)",),
)
