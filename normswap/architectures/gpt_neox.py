"""GPT-NeoX / Pythia: separate input and post-attention norms, rotary positions, untied head.

With ``use_parallel_residual`` the block is x + attn(ln_in(x)) + mlp(ln_post(x)); without it,
y = x + attn(ln_in(x)) and y + mlp(ln_post(y)). Either way each norm reads the stream and has
one reader (``query_key_value`` and ``dense_h_to_4h``), and the writers are the token table,
``attention.dense`` and ``mlp.dense_4h_to_h``: one adapter covers both. Checkpoints name the
head ``embed_out``; transformers renames it to ``lm_head`` on load and the plan does the same.
With ``attention_bias=False`` the input norm keeps β/γ (``query_key_value`` has no bias slot).
"""

from __future__ import annotations

from normswap.architectures.facts import COMMON_RENAMES, ModelFacts, StateDict, sole_class, stated
from normswap.architectures.layouts import decoder, megatron_block
from normswap.architectures.spec import assemble, pattern


def _facts(config: dict) -> ModelFacts:
    """GPTNeoXForCausalLM as GPTNeoXLayer builds it; transformers renames a checkpoint's ``embed_out``."""
    d = stated(config, "hidden_size", 6144, size=True)
    vocab = stated(config, "vocab_size", 50432, size=True)
    layers = stated(config, "num_hidden_layers", 44, size=True)
    inner = stated(config, "intermediate_size", 24576, size=True)
    bias = stated(config, "attention_bias", True)
    state = StateDict("gpt_neox", renames=((r"^embed_out\.", "lm_head."), *COMMON_RENAMES))
    state.add("gpt_neox.embed_in", weight=(vocab, d))
    for layer in range(layers):
        block = f"gpt_neox.layers.{layer}"
        state.layer_norm(block + ".input_layernorm", d).layer_norm(block + ".post_attention_layernorm", d)
        state.linear(block + ".attention.query_key_value", d, 3 * d, bias=bias)
        state.linear(block + ".attention.dense", d, d, bias=bias)
        state.linear(block + ".mlp.dense_h_to_4h", d, inner).linear(block + ".mlp.dense_4h_to_h", inner, d)
    return state.layer_norm("gpt_neox.final_layer_norm", d).add("lm_head", weight=(vocab, d)).facts()


GPT_NEOX = assemble(
    "gpt_neox", "AutoModelForCausalLM",
    decoder("gpt_neox.embed_in.weight", "gpt_neox.layers", "gpt_neox.final_layer_norm",
            tied_to="gpt_neox.embed_in.weight", **megatron_block("attention")),
    blocks="gpt_neox.layers",
    ignore=(pattern("gpt_neox.layers.{layer}.attention.{bias|masked_bias|rotary_emb.inv_freq}"),),
    **sole_class("GPTNeoXForCausalLM", _facts),
    tie_default=False,
    shared_context=True,
)
