"""GPT-Neo: GPT-2's block with nn.Linear layers, learned positions and local/global attention.

Writers: the token and position tables, each attention ``out_proj`` (weight and bias) and each
MLP ``c_proj``. ``ln_1`` is read by the bias-free ``q/k/v_proj``, so with ``--fold-gains`` its γ
folds into them and β stays in the norm as β/γ (the plan's policy when a reader has no bias
slot). The local attention window changes which positions are mixed, not what is written.
"""

from normswap.architectures.spec import assemble, embeddings, linear_reader, lm_head, pattern, pre_ln_blocks

GPT_NEO = assemble(
    "gpt_neo", "AutoModelForCausalLM",
    embeddings("transformer.{wte|wpe}.weight"),
    pre_ln_blocks(
        "transformer.h", writes="{attn.attention.out_proj|mlp.c_proj}",
        ln_1=tuple(linear_reader(f"attn.attention.{p}_proj", bias=False) for p in "qkv"),
        ln_2=linear_reader("mlp.c_fc"),
    ),
    lm_head("transformer.ln_f", tied_to="transformer.wte.weight"),
    blocks="transformer.h",
    # causal-mask buffers that old checkpoints carry; the current class rebuilds them
    ignore=(pattern("transformer.h.{layer}.attn.attention.{bias|masked_bias}"),),
)
