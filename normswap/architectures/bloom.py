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
    Architecture,
    EmbeddingNormBake,
    Norm,
    Writer,
    linear_reader,
    linear_writers,
    refuse_if,
)

H = "transformer.h.{layer}"


BLOOM = Architecture(
    model_types=("bloom",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("transformer.word_embeddings.weight", hidden_axis=1),
        *linear_writers(H + ".{self_attention.dense|mlp.dense_4h_to_h}"),
    ),
    norms=(
        Norm(H + ".input_layernorm", (linear_reader(H + ".self_attention.query_key_value"),)),
        Norm(H + ".post_attention_layernorm", (linear_reader(H + ".mlp.dense_h_to_4h"),)),
        Norm("transformer.ln_f", (linear_reader("lm_head", bias=False),)),
    ),
    tied=(("lm_head.weight", "transformer.word_embeddings.weight"),),
    bake=(EmbeddingNormBake("transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm"),),
    refuse=refuse_if(apply_residual_connection_post_layernorm=(
        "apply_residual_connection_post_layernorm makes each norm's output the residual, so the norms "
        "write the stream and their mean removal cannot be moved into the weights")),
    blocks="transformer.h",
)
