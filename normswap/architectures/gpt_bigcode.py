"""GPT-BigCode (SantaCoder, StarCoder): GPT-2's block with nn.Linear layers and multi-query attention.

Multi-query attention only changes ``c_attn``'s output width (one shared key/value head), which
is invisible to the surgery: ``c_attn`` reads ``ln_1`` along its input axis like any reader.
Writers: token and position tables, ``attn.c_proj`` and ``mlp.c_proj`` (weights [out, in] and
biases); cross-attention (when configured) reads the stream through ``q_attn`` only.
"""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, Unstated, sole_class, stated
from normswap.architectures.gpt2 import gpt2_sizes
from normswap.architectures.layouts import gpt2_layout
from normswap.architectures.spec import assemble, linear_reader, pattern


def _facts(config: dict) -> ModelFacts:
    """GPTBigCodeForCausalLM as GPTBigCodeBlock builds it (cross-attention is left to the class)."""
    d, vocab, positions, layers, heads, inner = gpt2_sizes(config)
    if stated(config, "add_cross_attention", False) or d % heads:
        raise Unstated("add_cross_attention")
    key_value = d // heads if stated(config, "multi_query", True) else d
    state = StateDict("transformer").add("transformer.wte", weight=(vocab, d)).add("transformer.wpe", weight=(positions, d))
    for layer in range(layers):
        block = f"transformer.h.{layer}"
        state.layer_norm(block + ".ln_1", d).linear(block + ".attn.c_attn", d, d + 2 * key_value)
        state.linear(block + ".attn.c_proj", d, d).layer_norm(block + ".ln_2", d)
        state.linear(block + ".mlp.c_fc", d, inner).linear(block + ".mlp.c_proj", inner, d)
    return state.layer_norm("transformer.ln_f", d).add("lm_head", weight=(vocab, d)).facts()


GPT_BIGCODE = assemble(
    "gpt_bigcode", "AutoModelForCausalLM",
    gpt2_layout(writes="{attn|crossattention|mlp}.c_proj", ln_1=linear_reader("attn.c_attn"),
                ln_cross_attn=linear_reader("crossattention.q_attn"), ln_2=linear_reader("mlp.c_fc")),
    blocks="transformer.h",
    ignore=(pattern("transformer.bias"), pattern("transformer.h.{layer}.attn.{bias|masked_bias}")),
    **sole_class("GPTBigCodeForCausalLM", _facts),
    tie_default=True,
    shared_context=True,
)
