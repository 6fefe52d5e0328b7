"""Phi (phi-1, phi-1.5, phi-2): a parallel block with a single norm, partial rotary, head with bias.

The block computes x + attn(ln(x)) + mlp(ln(x)): ``input_layernorm`` is read by ``q/k/v_proj``
and ``fc1``, all with biases, so its γ and β fold completely. The writers are the token table,
``self_attn.dense`` and ``mlp.fc2``. ``final_layernorm`` feeds an ``lm_head`` that has a bias, so
its β folds there too: with ``--fold-gains`` every norm of a Phi model is weightless.

``qk_layernorm`` (off in every released Phi checkpoint) normalises per-head query and key
vectors, which are not residual-stream writes; those norms cannot become RMSNorms by centring
the stream, so such checkpoints are refused.
"""

from normswap.architectures.spec import assemble, embeddings, linear_reader, lm_head, pre_ln_blocks, refuse_if

PHI = assemble(
    "phi", "AutoModelForCausalLM",
    embeddings("model.embed_tokens.weight"),
    # one norm feeds the attention and the MLP, which run side by side
    pre_ln_blocks("model.layers", writes="{self_attn.dense|mlp.fc2}", input_layernorm=(
        *(linear_reader(f"self_attn.{p}_proj") for p in "qkv"), linear_reader("mlp.fc1"))),
    lm_head("model.final_layernorm", bias=True, tied_to="model.embed_tokens.weight"),
    refuse=refuse_if(qk_layernorm="qk_layernorm normalises per-head queries and keys, which are not centred "
                     "by centring the residual stream; those LayerNorms cannot become RMSNorms exactly"),
    blocks="model.layers",
)
