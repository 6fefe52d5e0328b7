"""GPT-2: pre-LN blocks, Conv1D weights stored [in, out], learned positions, tied head."""

from __future__ import annotations

from normswap.architectures.facts import ModelFacts, StateDict, Unstated, sole_class, stated
from normswap.architectures.layouts import gpt2_layout
from normswap.architectures.spec import GPT2_SLICE_LAYOUT, assemble, conv1d_reader, pattern


def gpt2_sizes(config: dict) -> tuple[int, int, int, int, int, int]:
    """Width, vocabulary, positions, layers, heads and MLP width as GPT-2-style configs
    (GPT2Config, GPTBigCodeConfig) give them, with those classes' defaults."""
    d = stated(config, "n_embd", 768, size=True, aliases=("hidden_size",))
    vocab = stated(config, "vocab_size", 50257, size=True)
    positions = stated(config, "n_positions", 1024, size=True, aliases=("max_position_embeddings",))
    layers = stated(config, "n_layer", 12, size=True, aliases=("num_hidden_layers",))
    heads = stated(config, "n_head", 12, size=True, aliases=("num_attention_heads",))
    return d, vocab, positions, layers, heads, stated(config, "n_inner", None) or 4 * d


def _facts(config: dict) -> ModelFacts:
    """GPT2LMHeadModel as GPT2Block builds it (cross-attention when configured)."""
    d, vocab, positions, layers, heads, inner = gpt2_sizes(config)
    if d % heads or not isinstance(inner, int):
        raise Unstated("n_embd")  # the class refuses it in its own words
    state = StateDict("transformer").add("transformer.wte", weight=(vocab, d)).add("transformer.wpe", weight=(positions, d))
    for layer in range(layers):
        block = f"transformer.h.{layer}"
        state.layer_norm(block + ".ln_1", d).conv1d(block + ".attn.c_attn", d, 3 * d)
        state.conv1d(block + ".attn.c_proj", d, d).layer_norm(block + ".ln_2", d)
        if stated(config, "add_cross_attention", False):
            state.conv1d(block + ".crossattention.c_attn", d, 2 * d).conv1d(block + ".crossattention.q_attn", d, d)
            state.conv1d(block + ".crossattention.c_proj", d, d).layer_norm(block + ".ln_cross_attn", d)
        state.conv1d(block + ".mlp.c_fc", d, inner).conv1d(block + ".mlp.c_proj", inner, d)
    return state.layer_norm("transformer.ln_f", d).add("lm_head", weight=(vocab, d)).facts()


GPT2 = assemble(
    "gpt2", "AutoModelForCausalLM",
    gpt2_layout(
        writes="{attn|crossattention|mlp}.c_proj", conv1d=True,
        ln_1=conv1d_reader("attn.c_attn"),
        # cross-attention reads the stream only through its queries; keys/values read the encoder
        ln_cross_attn=conv1d_reader("crossattention.q_attn"),
        ln_2=conv1d_reader("mlp.c_fc"),
    ),
    blocks="transformer.h",
    # the causal-mask buffers that old checkpoints carry; current classes rebuild them
    ignore=(pattern("transformer.h.{layer}.{attn|crossattention}.{bias|masked_bias}"),),
    **sole_class("GPT2LMHeadModel", _facts),
    tie_default=True,
    slice_layout=GPT2_SLICE_LAYOUT,
    shared_context=True,
)
