"""Falcon: parallel blocks (one shared norm, or ln_attn/ln_mlp), sequential blocks, rotary or ALiBi.

transformers' FalconDecoderLayer has three wirings, all pre-LN:

* ``new_decoder_architecture`` with ``num_ln_in_parallel_attn`` 2 (Falcon-40B/180B): x +
  attn(ln_attn(x)) + mlp(ln_mlp(x)); each norm has one reader;
* ``parallel_attn`` with one norm (Falcon-7B; new architecture with ``num_ln_in_parallel_attn``
  1, as Falcon2-11B): x + attn(ln(x)) + mlp(ln(x)); ``input_layernorm`` is read by both
  ``query_key_value`` and ``dense_h_to_4h``;
* sequential (``parallel_attn`` false, e.g. falcon-rw): ``input_layernorm`` feeds attention and
  ``post_attention_layernorm`` the MLP.

Only ``input_layernorm``'s readers depend on the config, which ``_variant`` states. Writers are
the token table, ``self_attention.dense`` and ``mlp.dense_4h_to_h`` (and their biases when
``bias``); multi-query and grouped-query attention only change ``query_key_value``'s output
width. Rotary and ALiBi never write the stream. With ``bias=False`` the readers have no bias
slot, so every norm keeps β/γ when γ is folded.
"""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, sole_class, stated
from normswap.architectures.spec import Architecture, Norm, Writer, linear_reader, linear_writers

H = "transformer.h.{layer}"

_ATTN = linear_reader(H + ".self_attention.query_key_value")
_MLP = linear_reader(H + ".mlp.dense_h_to_4h")


def _norms(parallel: bool) -> tuple[Norm, ...]:
    return (
        Norm(H + ".ln_attn", (_ATTN,)),
        Norm(H + ".ln_mlp", (_MLP,)),
        Norm(H + ".input_layernorm", (_ATTN, _MLP) if parallel else (_ATTN,)),
        Norm(H + ".post_attention_layernorm", (_MLP,)),
        Norm("transformer.ln_f", (linear_reader("lm_head", bias=False),)),
    )


def _variant(config: dict) -> dict:
    return {} if config.get("parallel_attn", True) else {"norms": _norms(parallel=False)}



def _facts(config: dict) -> ModelFacts:
    """FalconForCausalLM as FalconDecoderLayer builds it, in each of its three wirings."""
    d = stated(config, "hidden_size", 4544, size=True, aliases=("n_embed",))
    vocab = stated(config, "vocab_size", 65024, size=True)
    layers = stated(config, "num_hidden_layers", 32, size=True, aliases=("n_layer",))
    heads = stated(config, "num_attention_heads", 71, size=True, aliases=("n_head",))
    new, parallel = stated(config, "new_decoder_architecture", False), stated(config, "parallel_attn", True)
    bias = stated(config, "bias", False)
    inner = stated(config, "ffn_hidden_size", None) or 4 * d
    head_dim = d // heads
    if new:
        fused = (2 * (stated(config, "num_kv_heads", None) or heads) + heads) * head_dim
    else:
        fused = d + 2 * head_dim if stated(config, "multi_query", True) else 3 * d
    two_norms = stated(config, "num_ln_in_parallel_attn", None) in ((2, None) if new else (2,))
    state = StateDict("transformer").add("transformer.word_embeddings", weight=(vocab, d))
    for layer in range(layers):
        block = f"transformer.h.{layer}"
        state.linear(block + ".self_attention.query_key_value", d, fused, bias=bias)
        state.linear(block + ".self_attention.dense", d, d, bias=bias)
        state.linear(block + ".mlp.dense_h_to_4h", d, inner, bias=bias).linear(block + ".mlp.dense_4h_to_h", inner, d, bias=bias)
        if not parallel:
            state.layer_norm(block + ".post_attention_layernorm", d).layer_norm(block + ".input_layernorm", d)
        elif two_norms:
            state.layer_norm(block + ".ln_attn", d).layer_norm(block + ".ln_mlp", d)
        else:
            state.layer_norm(block + ".input_layernorm", d)
    return state.layer_norm("transformer.ln_f", d).add("lm_head", weight=(vocab, d)).facts()


FALCON = Architecture(
    model_types=("falcon",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("transformer.word_embeddings.weight", hidden_axis=1),
        *linear_writers(H + ".{self_attention.dense|mlp.dense_4h_to_h}"),
    ),
    norms=_norms(parallel=True),
    tied=(("lm_head.weight", "transformer.word_embeddings.weight"),),
    variant=_variant,
    blocks="transformer.h",
    **sole_class("FalconForCausalLM", _facts),
    tie_default=True,
    shared_context=True,
)
