"""GPT-Neo: GPT-2's block with nn.Linear layers, learned positions and local/global attention.

Writers: the token and position tables, each attention ``out_proj`` (weight and bias) and each
MLP ``c_proj``. ``ln_1`` is read by the bias-free ``q/k/v_proj``, so with ``--fold-gains`` its γ
folds into them and β stays in the norm as β/γ (the plan's policy when a reader has no bias
slot). The local attention window changes which positions are mixed, not what is written.
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

H = r"transformer\.h\.(?P<layer>\d+)"
L = "transformer.h.{layer}"

GPT_NEO = Architecture(
    model_types=("gpt_neo",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"transformer\.(wte|wpe)\.weight", hidden_axis=1),
        Writer(H + r"\.(attn\.attention\.out_proj|mlp\.c_proj)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(attn\.attention\.out_proj|mlp\.c_proj)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.ln_1", tuple(Reader(f"{L}.attn.attention.{p}_proj.weight", LINEAR_IN_AXIS) for p in "qkv")),
        Norm(H + r"\.ln_2", (Reader(f"{L}.mlp.c_fc.weight", LINEAR_IN_AXIS, f"{L}.mlp.c_fc.bias"),)),
        Norm(r"transformer\.ln_f", (Reader("lm_head.weight", LINEAR_IN_AXIS),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    # causal-mask buffers that old checkpoints carry; the current class rebuilds them
    ignore=(H + r"\.attn\.attention\.(bias|masked_bias)",),
)
