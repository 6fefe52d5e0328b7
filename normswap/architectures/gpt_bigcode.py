"""GPT-BigCode (SantaCoder, StarCoder): GPT-2's block with nn.Linear layers and multi-query attention.

Multi-query attention only changes ``c_attn``'s output width (one shared key/value head), which
is invisible to the surgery: ``c_attn`` reads ``ln_1`` along its input axis like any reader.
Writers: token and position tables, ``attn.c_proj`` and ``mlp.c_proj`` (weights [out, in] and
biases); cross-attention (when configured) reads the stream through ``q_attn`` only.
"""

from normswap.architectures.spec import Architecture, Norm, Writer, linear_reader, linear_writers, pattern

H = "transformer.h.{layer}"

GPT_BIGCODE = Architecture(
    model_types=("gpt_bigcode",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("transformer.{wte|wpe}.weight", hidden_axis=1),
        *linear_writers(H + ".{attn|crossattention|mlp}.c_proj"),
    ),
    norms=(
        Norm(H + ".ln_1", (linear_reader(H + ".attn.c_attn"),)),
        Norm(H + ".ln_cross_attn", (linear_reader(H + ".crossattention.q_attn"),)),
        Norm(H + ".ln_2", (linear_reader(H + ".mlp.c_fc"),)),
        Norm("transformer.ln_f", (linear_reader("lm_head", bias=False),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    ignore=(pattern("transformer.bias"), pattern(H + ".attn.{bias|masked_bias}")),
)
