"""GPT-2: pre-LN blocks, Conv1D weights stored [in, out], learned positions, tied head."""

from normswap.architectures.spec import (
    CONV1D_IN_AXIS,
    CONV1D_OUT_AXIS,
    LINEAR_IN_AXIS,
    Architecture,
    Norm,
    Reader,
    Writer,
)

H = r"transformer\.h\.(?P<layer>\d+)"

GPT2 = Architecture(
    model_types=("gpt2",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"transformer\.wte\.weight", hidden_axis=1),
        Writer(r"transformer\.wpe\.weight", hidden_axis=1),
        Writer(H + r"\.(attn|crossattention|mlp)\.c_proj\.weight", hidden_axis=CONV1D_OUT_AXIS),
        Writer(H + r"\.(attn|crossattention|mlp)\.c_proj\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.ln_1", (Reader("transformer.h.{layer}.attn.c_attn.weight", CONV1D_IN_AXIS, "transformer.h.{layer}.attn.c_attn.bias"),)),
        # cross-attention reads the stream only through its queries; keys/values read the encoder
        Norm(H + r"\.ln_cross_attn", (Reader("transformer.h.{layer}.crossattention.q_attn.weight", CONV1D_IN_AXIS, "transformer.h.{layer}.crossattention.q_attn.bias"),)),
        Norm(H + r"\.ln_2", (Reader("transformer.h.{layer}.mlp.c_fc.weight", CONV1D_IN_AXIS, "transformer.h.{layer}.mlp.c_fc.bias"),)),
        Norm(r"transformer\.ln_f", (Reader("lm_head.weight", LINEAR_IN_AXIS),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    # the causal-mask buffers that old checkpoints carry; current classes rebuild them
    ignore=(H + r"\.(attn|crossattention)\.(bias|masked_bias)",),
)
