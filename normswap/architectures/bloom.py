"""BLOOM: an embedding LayerNorm baked into the table, ALiBi (no position writer), tied head.

The stream starts as ``word_embeddings_layernorm(E[i])``: a norm of a lookup is itself a lookup
table, so the plan bakes LN(E[i]) per row in float64 and then centres the rows (the
``EmbeddingNormBake``). The converted model has no embedding norm, which the stock BloomModel
cannot express, so the output gets its own model type (stock transformers refuses it) and the
RMSNorm class replaces that norm by ``nn.Identity``. The tied head is untied first, so it keeps
the original, un-normalised table.

Writers: the (baked) token table, ``self_attention.dense`` and ``mlp.dense_4h_to_h``. ALiBi adds
position biases to attention scores and never writes the stream. A checkpoint with
``apply_residual_connection_post_layernorm`` adds the norms' outputs into the stream (the norms
are writers) and is refused.
"""

from normswap.architectures.spec import (
    EmbeddingNormBake,
    assemble,
    embeddings,
    linear_reader,
    lm_head,
    pre_ln_blocks,
    refuse_if,
)

BLOOM = assemble(
    "bloom", "AutoModelForCausalLM",
    embeddings("transformer.word_embeddings.weight"),
    pre_ln_blocks("transformer.h", writes="{self_attention.dense|mlp.dense_4h_to_h}",
                  input_layernorm=linear_reader("self_attention.query_key_value"),
                  post_attention_layernorm=linear_reader("mlp.dense_h_to_4h")),
    lm_head("transformer.ln_f", tied_to="transformer.word_embeddings.weight"),
    bake=(EmbeddingNormBake("transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm"),),
    refuse=refuse_if(apply_residual_connection_post_layernorm=(
        "apply_residual_connection_post_layernorm makes each norm's output the residual, so the norms "
        "write the stream and their mean removal cannot be moved into the weights")),
    blocks="transformer.h",
)
