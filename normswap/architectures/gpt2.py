"""GPT-2: pre-LN blocks, Conv1D weights stored [in, out], learned positions, tied head."""

from normswap.architectures.spec import assemble, conv1d_reader, embeddings, lm_head, pattern, pre_ln_blocks

GPT2 = assemble(
    "gpt2", "AutoModelForCausalLM",
    embeddings("transformer.{wte|wpe}.weight"),
    pre_ln_blocks(
        "transformer.h", writes="{attn|crossattention|mlp}.c_proj", conv1d=True,
        ln_1=conv1d_reader("attn.c_attn"),
        # cross-attention reads the stream only through its queries; keys/values read the encoder
        ln_cross_attn=conv1d_reader("crossattention.q_attn"),
        ln_2=conv1d_reader("mlp.c_fc"),
    ),
    lm_head("transformer.ln_f", tied_to="transformer.wte.weight"),
    blocks="transformer.h",
    # the causal-mask buffers that old checkpoints carry; current classes rebuild them
    ignore=(pattern("transformer.h.{layer}.{attn|crossattention}.{bias|masked_bias}"),),
)
