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
    LINEAR_IN_AXIS,
    LINEAR_OUT_AXIS,
    Architecture,
    EmbeddingNormBake,
    Norm,
    Reader,
    Writer,
)

H = r"transformer\.h\.(?P<layer>\d+)"
L = "transformer.h.{layer}"


def _refuse(config: dict) -> str | None:
    if config.get("apply_residual_connection_post_layernorm"):
        return ("apply_residual_connection_post_layernorm makes each norm's output the residual, so the "
                "norms write the stream and their mean removal cannot be moved into the weights")
    return None


BLOOM = Architecture(
    model_types=("bloom",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"transformer\.word_embeddings\.weight", hidden_axis=1),
        Writer(H + r"\.(self_attention\.dense|mlp\.dense_4h_to_h)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(self_attention\.dense|mlp\.dense_4h_to_h)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.input_layernorm", (
            Reader(f"{L}.self_attention.query_key_value.weight", LINEAR_IN_AXIS, f"{L}.self_attention.query_key_value.bias"),
        )),
        Norm(H + r"\.post_attention_layernorm", (
            Reader(f"{L}.mlp.dense_h_to_4h.weight", LINEAR_IN_AXIS, f"{L}.mlp.dense_h_to_4h.bias"),
        )),
        Norm(r"transformer\.ln_f", (Reader("lm_head.weight", LINEAR_IN_AXIS),)),
    ),
    tied=(("lm_head.weight", "transformer.word_embeddings.weight"),),
    bake=(EmbeddingNormBake("transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm"),),
    refuse=_refuse,
    blocks="transformer.h",
)
