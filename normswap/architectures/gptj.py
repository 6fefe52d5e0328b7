"""GPT-J: one norm feeds attention and MLP in parallel; rotary positions; a head with a bias.

The block computes x + attn(ln_1(x)) + mlp(ln_1(x)), so ``ln_1`` has four readers (the
bias-free ``q/k/v_proj`` and ``fc_in``) and the writers are ``out_proj`` (no bias) and ``fc_out``.
Rotary embeddings rotate queries and keys and never write the stream, so only the token table
is a position-free embedding writer. ``lm_head`` has a bias, so ``ln_f``'s β folds into it; ``ln_1``
keeps β/γ because ``q/k/v_proj`` have no bias slot. (A key constant would cancel in softmax, but
not after rotary rotates it by position, so keys are not marked ``constant_cancels``.)
"""

from __future__ import annotations

from collections.abc import Callable

from normswap.architectures.facts import ModelFacts, StateDict, sole_class, stated
from normswap.architectures.spec import (
    Architecture,
    Norm,
    Reader,
    Writer,
    linear_reader,
    linear_writers,
    pattern,
)

H = "transformer.h.{layer}"


def parallel_block_norms(*attention: Reader) -> tuple[Norm, ...]:
    """``ln_1`` read by the attention's input projections and ``fc_in``; ``ln_f`` by a head with a bias."""
    return (
        Norm(H + ".ln_1", (*attention, linear_reader(H + ".mlp.fc_in"))),
        Norm("transformer.ln_f", (linear_reader("lm_head"),)),
    )



def parallel_block_facts(attention: Callable[[StateDict, str, int], object]) -> Callable[[dict], ModelFacts]:
    """GPTJForCausalLM (CodeGenForCausalLM) as its block builds it; ``attention(state, prefix, d)``
    adds the attention's projections (they differ between the two families)."""

    def facts(config: dict) -> ModelFacts:
        d = stated(config, "n_embd", 4096, size=True, aliases=("hidden_size",))
        vocab = stated(config, "vocab_size", 50400, size=True)
        layers = stated(config, "n_layer", 28, size=True, aliases=("num_hidden_layers",))
        stated(config, "n_head", 16, size=True, aliases=("num_attention_heads",))
        inner = stated(config, "n_inner", None) or 4 * d
        state = StateDict("transformer").add("transformer.wte", weight=(vocab, d))
        for layer in range(layers):
            block = f"transformer.h.{layer}"
            state.layer_norm(block + ".ln_1", d)
            attention(state, block + ".attn", d)
            state.linear(block + ".mlp.fc_in", d, inner).linear(block + ".mlp.fc_out", inner, d)
        return state.layer_norm("transformer.ln_f", d).linear("lm_head", d, vocab).facts()

    return facts


def _attention(state: StateDict, attention: str, d: int) -> None:
    for projection in ("k_proj", "v_proj", "q_proj", "out_proj"):
        state.linear(f"{attention}.{projection}", d, d, bias=False)


GPTJ = Architecture(
    model_types=("gptj",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("transformer.wte.weight", hidden_axis=1),
        *linear_writers(H + ".{attn.out_proj|mlp.fc_out}"),
    ),
    norms=parallel_block_norms(*(linear_reader(f"{H}.attn.{p}_proj", bias=False) for p in "qkv")),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    ignore=(pattern(H + ".attn.{bias|masked_bias}"),),
    **sole_class("GPTJForCausalLM", parallel_block_facts(_attention)),
    tie_default=False,
    shared_context=True,
)
