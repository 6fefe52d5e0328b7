"""Phi (phi-1, phi-1.5, phi-2): a parallel block with a single norm, partial rotary, head with bias.

The block computes x + attn(ln(x)) + mlp(ln(x)): ``input_layernorm`` is read by ``q/k/v_proj``
and ``fc1``, all with biases, so its γ and β fold completely. The writers are the token table,
``self_attn.dense`` and ``mlp.fc2``. ``final_layernorm`` feeds an ``lm_head`` that has a bias, so
its β folds there too: with ``--fold-gains`` every norm of a Phi model is weightless.

``qk_layernorm`` (off in every released Phi checkpoint) normalises per-head query and key
vectors, which are not residual-stream writes; those norms cannot become RMSNorms by centring
the stream, so such checkpoints are refused.
"""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, Unstated, sole_class, stated
from normswap.architectures.layouts import llama_layout
from normswap.architectures.spec import assemble, attention_readers, linear_reader, refuse_if


def _facts(config: dict) -> ModelFacts:
    """PhiForCausalLM as PhiDecoderLayer builds it (qk_layernorm, which is refused, is not declared)."""
    d = stated(config, "hidden_size", 2048, size=True)
    vocab = stated(config, "vocab_size", 51200, size=True)
    layers = stated(config, "num_hidden_layers", 24, size=True)
    heads = stated(config, "num_attention_heads", 32, size=True)
    kv_heads = stated(config, "num_key_value_heads", None) or heads
    inner = stated(config, "intermediate_size", 8192, size=True)
    if stated(config, "qk_layernorm", False) or d % heads:
        raise Unstated("qk_layernorm")
    head_dim = d // heads
    state = StateDict("model").add("model.embed_tokens", weight=(vocab, d))
    for layer in range(layers):
        block = f"model.layers.{layer}"
        state.linear(block + ".self_attn.q_proj", d, heads * head_dim)
        state.linear(block + ".self_attn.k_proj", d, kv_heads * head_dim)
        state.linear(block + ".self_attn.v_proj", d, kv_heads * head_dim)
        state.linear(block + ".self_attn.dense", heads * head_dim, d)
        state.linear(block + ".mlp.fc1", d, inner).linear(block + ".mlp.fc2", inner, d)
        state.layer_norm(block + ".input_layernorm", d)
    return state.layer_norm("model.final_layernorm", d).linear("lm_head", d, vocab).facts()


PHI = assemble(
    "phi", "AutoModelForCausalLM",
    # one norm feeds the attention and the MLP, which run side by side
    llama_layout(writes="{self_attn.dense|mlp.fc2}", final_norm="model.final_layernorm", head_bias=True,
                 input_layernorm=(*attention_readers("self_attn", rotary=True), linear_reader("mlp.fc1"))),
    refuse=refuse_if(qk_layernorm="qk_layernorm normalises per-head queries and keys, which are not centred "
                     "by centring the residual stream; those LayerNorms cannot become RMSNorms exactly"),
    blocks="model.layers",
    **sole_class("PhiForCausalLM", _facts),
    tie_default=False,
    shared_context=True,
)
