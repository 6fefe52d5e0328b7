"""StableLM: Llama-style blocks with LayerNorms, optional parallel residual and per-head q/k norms.

Sequential: ``input_layernorm`` feeds q/k/v_proj and ``post_attention_layernorm`` the gated MLP
(``gate_proj`` and ``up_proj``); with ``use_parallel_residual`` the one ``input_layernorm`` feeds
both, x + attn(ln(x)) + mlp(ln(x)). Writers: the token table, ``o_proj`` and ``down_proj``.

``qk_layernorm``: a LayerNorm per head (``q_layernorm.norms.{head}``) on each head's query and key.
Centring each head's rows of q_proj and k_proj makes those inputs zero-mean, so they become
RMSNorms exactly (``HeadNorm``); their gains stay.
"""

from __future__ import annotations

from normswap.architectures.layouts import gated_mlp_readers, llama_layout
from normswap.architectures.spec import HeadNorm, assemble, attention_readers

H = "model.layers.{layer}"
_ATTENTION = attention_readers("self_attn", rotary=True)
_MLP = gated_mlp_readers("mlp")
_WRITES = "{self_attn.o_proj|mlp.down_proj}"


def _variant(config: dict) -> dict:
    if not config.get("use_parallel_residual", False):
        return {}
    return {"norms": llama_layout(writes=_WRITES, input_layernorm=(*_ATTENTION, *_MLP)).norms}


STABLELM = assemble(
    "stablelm", "AutoModelForCausalLM",
    llama_layout(writes=_WRITES, input_layernorm=_ATTENTION, post_attention_layernorm=_MLP),
    head_norms=tuple(HeadNorm(f"{H}.self_attn.{p}_layernorm.norms.{{head}}", f"{H}.self_attn.{p}_proj") for p in "qk"),
    variant=_variant,
    blocks="model.layers",
)
