"""Phi (phi-1, phi-1.5, phi-2): a parallel block with a single norm, partial rotary, head with bias.

The block computes x + attn(ln(x)) + mlp(ln(x)): ``input_layernorm`` is read by ``q/k/v_proj``
and ``fc1``, all with biases, so its γ and β fold completely. The writers are the token table,
``self_attn.dense`` and ``mlp.fc2``. ``final_layernorm`` feeds an ``lm_head`` that has a bias, so
its β folds there too: with ``--fold-gains`` every norm of a Phi model is weightless.

``qk_layernorm`` (off in every released Phi checkpoint) normalises per-head query and key
vectors, which are not residual-stream writes; those norms cannot become RMSNorms by centring
the stream, so such checkpoints are refused.
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

H = r"model\.layers\.(?P<layer>\d+)"
L = "model.layers.{layer}"


def _refuse(config: dict) -> str | None:
    if config.get("qk_layernorm"):
        return ("qk_layernorm normalises per-head queries and keys, which are not centred by "
                "centring the residual stream; those LayerNorms cannot become RMSNorms exactly")
    return None


PHI = Architecture(
    model_types=("phi",),
    auto_class="AutoModelForCausalLM",
    writers=(
        Writer(r"model\.embed_tokens\.weight", hidden_axis=1),
        Writer(H + r"\.(self_attn\.dense|mlp\.fc2)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(H + r"\.(self_attn\.dense|mlp\.fc2)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(H + r"\.input_layernorm", (
            *(Reader(f"{L}.self_attn.{p}_proj.weight", LINEAR_IN_AXIS, f"{L}.self_attn.{p}_proj.bias") for p in "qkv"),
            Reader(f"{L}.mlp.fc1.weight", LINEAR_IN_AXIS, f"{L}.mlp.fc1.bias"),
        )),
        Norm(r"model\.final_layernorm", (Reader("lm_head.weight", LINEAR_IN_AXIS, "lm_head.bias"),)),
    ),
    tied=(("lm_head.weight", "model.embed_tokens.weight"),),
    refuse=_refuse,
    blocks="model.layers",
)
