"""GPT-BigCode (SantaCoder, StarCoder): GPT-2's block with nn.Linear layers and multi-query attention.

Multi-query attention only changes ``c_attn``'s output width (one shared key/value head), which
is invisible to the surgery: ``c_attn`` reads ``ln_1`` along its input axis like any reader.
Writers: token and position tables, ``attn.c_proj`` and ``mlp.c_proj`` (weights [out, in] and
biases); cross-attention (when configured) reads the stream through ``q_attn`` only.
"""

from normswap.architectures.spec import assemble, embeddings, linear_reader, lm_head, pattern, pre_ln_blocks

GPT_BIGCODE = assemble(
    "gpt_bigcode", "AutoModelForCausalLM",
    embeddings("transformer.{wte|wpe}.weight"),
    pre_ln_blocks("transformer.h", writes="{attn|crossattention|mlp}.c_proj", ln_1=linear_reader("attn.c_attn"),
                  ln_cross_attn=linear_reader("crossattention.q_attn"), ln_2=linear_reader("mlp.c_fc")),
    lm_head("transformer.ln_f", tied_to="transformer.wte.weight"),
    blocks="transformer.h",
    ignore=(pattern("transformer.bias"), pattern("transformer.h.{layer}.attn.{bias|masked_bias}")),
)
