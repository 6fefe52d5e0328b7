"""GPT-J: one norm feeds attention and MLP in parallel; rotary positions; a head with a bias.

The block computes x + attn(ln_1(x)) + mlp(ln_1(x)), so ``ln_1`` has four readers (the
bias-free ``q/k/v_proj`` and ``fc_in``) and the writers are ``out_proj`` (no bias) and ``fc_out``.
Rotary embeddings rotate queries and keys and never write the stream, so only the token table
is a position-free embedding writer. ``lm_head`` has a bias, so ``ln_f``'s β folds into it; ``ln_1``
keeps β/γ because ``q/k/v_proj`` have no bias slot. (A key constant would cancel in softmax, but
not after rotary rotates it by position, so keys are not marked ``constant_cancels``.)
"""

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
)
