"""Phi (phi-1, phi-1.5, phi-2): a parallel block with a single norm, partial rotary, head with bias.

The block computes x + attn(ln(x)) + mlp(ln(x)): ``input_layernorm`` is read by ``q/k/v_proj``
and ``fc1``, all with biases, so its γ and β fold completely. The writers are the token table,
``self_attn.dense`` and ``mlp.fc2``. ``final_layernorm`` feeds an ``lm_head`` that has a bias, so
its β folds there too: with ``--fold-gains`` every norm of a Phi model is weightless.

``qk_layernorm`` (off in every released Phi checkpoint) normalises per-head query and key
vectors, which are not residual-stream writes; those norms cannot become RMSNorms by centring
the stream, so such checkpoints are refused.
"""

from normswap.architectures.spec import Architecture, Norm, Writer, linear_reader, linear_writers, refuse_if

H = "model.layers.{layer}"


PHI = Architecture(
    model_types=("phi",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer("model.embed_tokens.weight", hidden_axis=1),
        *linear_writers(H + ".{self_attn.dense|mlp.fc2}"),
    ),
    norms=(
        Norm(H + ".input_layernorm", (
            *(linear_reader(f"{H}.self_attn.{p}_proj") for p in "qkv"), linear_reader(H + ".mlp.fc1"),
        )),
        Norm("model.final_layernorm", (linear_reader("lm_head"),)),
    ),
    tied=(("lm_head.weight", "model.embed_tokens.weight"),),
    refuse=refuse_if(qk_layernorm="qk_layernorm normalises per-head queries and keys, which are not centred "
                     "by centring the residual stream; those LayerNorms cannot become RMSNorms exactly"),
    blocks="model.layers",
)
