"""GPT-J: one norm feeds attention and MLP in parallel; rotary positions; a head with a bias.

The block computes x + attn(ln_1(x)) + mlp(ln_1(x)), so ``ln_1`` has four readers (the
bias-free ``q/k/v_proj`` and ``fc_in``) and the writers are ``out_proj`` (no bias) and ``fc_out``.
Rotary embeddings rotate queries and keys and never write the stream, so only the token table
is a position-free embedding writer. ``lm_head`` has a bias, so ``ln_f``'s β folds into it; ``ln_1``
keeps β/γ because ``q/k/v_proj`` have no bias slot. (A key constant would cancel in softmax, but
not after rotary rotates it by position, so keys are not marked ``constant_cancels``.)
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

H = r"transformer\.h\.(?P<layer>\d+)"
L = "transformer.h.{layer}"

GPTJ = Architecture(
    model_types=("gptj",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"transformer\.wte\.weight", hidden_axis=1),
        Writer(H + r"\.(attn\.out_proj|mlp\.fc_out)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(attn\.out_proj|mlp\.fc_out)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.ln_1", (
            *(Reader(f"{L}.attn.{p}_proj.weight", LINEAR_IN_AXIS) for p in "qkv"),
            Reader(f"{L}.mlp.fc_in.weight", LINEAR_IN_AXIS, f"{L}.mlp.fc_in.bias"),
        )),
        Norm(r"transformer\.ln_f", (Reader("lm_head.weight", LINEAR_IN_AXIS, "lm_head.bias"),)),
    ),
    tied=(("lm_head.weight", "transformer.wte.weight"),),
    blocks="transformer.h",
    ignore=(H + r"\.attn\.(bias|masked_bias)",),
)
