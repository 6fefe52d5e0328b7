"""GPT-2: pre-LN blocks, Conv1D weights stored [in, out], learned positions, tied head."""

from normswap.architectures.spec import (
    Architecture,
    Norm,
    Writer,
    conv1d_reader,
    linear_reader,
    linear_writers,
    pattern,
)

H = "transformer.h.{layer}"

GPT2 = Architecture(
    model_types=("gpt2",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("transformer.{wte|wpe}.weight", hidden_axis=1),
        *linear_writers(H + ".{attn|crossattention|mlp}.c_proj", conv1d=True),
    ),
    norms=(
        Norm(H + ".ln_1", (conv1d_reader(H + ".attn.c_attn"),)),
        # cross-attention reads the stream only through its queries; keys/values read the encoder
        Norm(H + ".ln_cross_attn", (conv1d_reader(H + ".crossattention.q_attn"),)),
        Norm(H + ".ln_2", (conv1d_reader(H + ".mlp.c_fc"),)),
        Norm("transformer.ln_f", (linear_reader("lm_head", bias=False),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    # the causal-mask buffers that old checkpoints carry; current classes rebuild them
    ignore=(pattern(H + ".{attn|crossattention}.{bias|masked_bias}"),),
)
