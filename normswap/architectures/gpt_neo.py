"""GPT-Neo: GPT-2's block with nn.Linear layers, learned positions and local/global attention.

Writers: the token and position tables, each attention ``out_proj`` (weight and bias) and each
MLP ``c_proj``. ``ln_1`` is read by the bias-free ``q/k/v_proj``, so with ``--fold-gains`` its γ
folds into them and β stays in the norm as β/γ (the plan's policy when a reader has no bias
slot). The local attention window changes which positions are mixed, not what is written.
"""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, sole_class, stated
from normswap.architectures.layouts import gpt2_layout
from normswap.architectures.spec import GPT2_SLICE_LAYOUT, assemble, linear_reader, pattern


def _facts(config: dict) -> ModelFacts:
    """GPTNeoForCausalLM as GPTNeoBlock builds it."""
    d = stated(config, "hidden_size", 2048, size=True)
    vocab = stated(config, "vocab_size", 50257, size=True)
    positions = stated(config, "max_position_embeddings", 2048, size=True)
    layers = stated(config, "num_layers", 24, size=True, aliases=("num_hidden_layers",))
    stated(config, "num_heads", 16, size=True, aliases=("num_attention_heads",))
    inner = stated(config, "intermediate_size", None) or 4 * d
    state = StateDict("transformer").add("transformer.wte", weight=(vocab, d)).add("transformer.wpe", weight=(positions, d))
    for layer in range(layers):
        block = f"transformer.h.{layer}"
        state.layer_norm(block + ".ln_1", d)
        for projection in ("k_proj", "v_proj", "q_proj"):
            state.linear(f"{block}.attn.attention.{projection}", d, d, bias=False)
        state.linear(block + ".attn.attention.out_proj", d, d).layer_norm(block + ".ln_2", d)
        state.linear(block + ".mlp.c_fc", d, inner).linear(block + ".mlp.c_proj", inner, d)
    return state.layer_norm("transformer.ln_f", d).add("lm_head", weight=(vocab, d)).facts()


GPT_NEO = assemble(
    "gpt_neo", "AutoModelForCausalLM",
    gpt2_layout(writes="{attn.attention.out_proj|mlp.c_proj}",
                ln_1=tuple(linear_reader(f"attn.attention.{p}_proj", bias=False) for p in "qkv"),
                ln_2=linear_reader("mlp.c_fc")),
    blocks="transformer.h",
    # causal-mask buffers that old checkpoints carry; the current class rebuilds them
    ignore=(pattern("transformer.h.{layer}.attn.attention.{bias|masked_bias}"),),
    **sole_class("GPTNeoForCausalLM", _facts),
    tie_default=True,
    slice_layout=GPT2_SLICE_LAYOUT,
    shared_context=True,
)
