"""GPT-Neo: GPT-2's block with nn.Linear layers, learned positions and local/global attention.

Writers: the token and position tables, each attention ``out_proj`` (weight and bias) and each
MLP ``c_proj``. ``ln_1`` is read by the bias-free ``q/k/v_proj``, so with ``--fold-gains`` its γ
folds into them and β stays in the norm as β/γ (the plan's policy when a reader has no bias
slot). The local attention window changes which positions are mixed, not what is written.
"""

from normswap.architectures.spec import Architecture, Norm, Writer, linear_reader, linear_writers, pattern

H = "transformer.h.{layer}"

GPT_NEO = Architecture(
    model_types=("gpt_neo",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("transformer.{wte|wpe}.weight", hidden_axis=1),
        *linear_writers(H + ".{attn.attention.out_proj|mlp.c_proj}"),
    ),
    norms=(
        Norm(H + ".ln_1", tuple(linear_reader(f"{H}.attn.attention.{p}_proj", bias=False) for p in "qkv")),
        Norm(H + ".ln_2", (linear_reader(H + ".mlp.c_fc"),)),
        Norm("transformer.ln_f", (linear_reader("lm_head", bias=False),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    # causal-mask buffers that old checkpoints carry; the current class rebuilds them
    ignore=(pattern(H + ".attn.attention.{bias|masked_bias}"),),
)
