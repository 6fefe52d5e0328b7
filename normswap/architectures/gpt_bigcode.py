"""GPT-BigCode (SantaCoder, StarCoder): GPT-2's block with nn.Linear layers and multi-query attention.

Multi-query attention only changes ``c_attn``'s output width (one shared key/value head), which
is invisible to the surgery: ``c_attn`` reads ``ln_1`` along its input axis like any reader.
Writers: token and position tables, ``attn.c_proj`` and ``mlp.c_proj`` (weights [out, in] and
biases); cross-attention (when configured) reads the stream through ``q_attn`` only.
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

H = r"transformer\.h\.(?P<layer>\d+)"
L = "transformer.h.{layer}"

GPT_BIGCODE = Architecture(
    model_types=("gpt_bigcode",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"transformer\.(wte|wpe)\.weight", hidden_axis=1),
        Writer(H + r"\.(attn|crossattention|mlp)\.c_proj\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(attn|crossattention|mlp)\.c_proj\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.ln_1", (Reader(f"{L}.attn.c_attn.weight", LINEAR_IN_AXIS, f"{L}.attn.c_attn.bias"),)),
        Norm(H + r"\.ln_cross_attn", (
            Reader(f"{L}.crossattention.q_attn.weight", LINEAR_IN_AXIS, f"{L}.crossattention.q_attn.bias"),
        )),
        Norm(H + r"\.ln_2", (Reader(f"{L}.mlp.c_fc.weight", LINEAR_IN_AXIS, f"{L}.mlp.c_fc.bias"),)),
        Norm(r"transformer\.ln_f", (Reader("lm_head.weight", LINEAR_IN_AXIS),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    ignore=(r"transformer\.bias", H + r"\.attn\.(bias|masked_bias)"),
)
