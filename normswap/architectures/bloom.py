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

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, sole_class, stated
from normswap.architectures.layouts import decoder, megatron_block
from normswap.architectures.spec import EmbeddingNormBake, assemble, refuse_if


def _facts(config: dict) -> ModelFacts:
    """BloomForCausalLM as BloomBlock builds it."""
    d = stated(config, "hidden_size", 64, size=True, aliases=("n_embed",))
    vocab = stated(config, "vocab_size", 250880, size=True)
    layers = stated(config, "n_layer", 2, size=True, aliases=("num_hidden_layers",))
    stated(config, "n_head", 8, size=True, aliases=("num_attention_heads",))
    state = StateDict("transformer").add("transformer.word_embeddings", weight=(vocab, d))
    state.layer_norm("transformer.word_embeddings_layernorm", d)
    for layer in range(layers):
        block = f"transformer.h.{layer}"
        state.layer_norm(block + ".input_layernorm", d).linear(block + ".self_attention.query_key_value", d, 3 * d)
        state.linear(block + ".self_attention.dense", d, d).layer_norm(block + ".post_attention_layernorm", d)
        state.linear(block + ".mlp.dense_h_to_4h", d, 4 * d).linear(block + ".mlp.dense_4h_to_h", 4 * d, d)
    return state.layer_norm("transformer.ln_f", d).add("lm_head", weight=(vocab, d)).facts()


BLOOM = assemble(
    "bloom", "AutoModelForCausalLM",
    decoder("transformer.word_embeddings.weight", "transformer.h", "transformer.ln_f",
            tied_to="transformer.word_embeddings.weight", **megatron_block("self_attention")),
    bake=(EmbeddingNormBake("transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm"),),
    refuse=refuse_if(apply_residual_connection_post_layernorm=(
        "apply_residual_connection_post_layernorm makes each norm's output the residual, so the norms "
        "write the stream and their mean removal cannot be moved into the weights")),
    blocks="transformer.h",
    **sole_class("BloomForCausalLM", _facts),
    # the stream starts as word_embeddings_layernorm's output γ ⊙ LN(E[i]) + β: no γ' makes
    # γ' ⊙ LN(e') equal (γ ⊙ LN(e))·Q, so the stock class cannot start the stream rotated
    fixed_streams=lambda config: {"": "the stream starts as word_embeddings_layernorm's output γ ⊙ LN(e) + β, and "
                                      "diag(γ) does not commute with Q"},
    tie_default=True,
    shared_context=True,
)
