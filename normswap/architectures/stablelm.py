"""StableLM: Llama-style blocks with LayerNorms, optional parallel residual and per-head q/k norms.

Sequential: ``input_layernorm`` feeds q/k/v_proj and ``post_attention_layernorm`` the gated MLP
(``gate_proj`` and ``up_proj``); with ``use_parallel_residual`` the one ``input_layernorm`` feeds
both, x + attn(ln(x)) + mlp(ln(x)). Writers: the token table, ``o_proj`` and ``down_proj``.

``qk_layernorm``: a LayerNorm per head (``q_layernorm.norms.{head}``) on each head's query and key.
Centring each head's rows of q_proj and k_proj makes those inputs zero-mean, so they become
RMSNorms exactly (``HeadNorm``); their gains stay.
"""

from __future__ import annotations

from normswap.architectures.spec import (
    HeadNorm,
    assemble,
    embeddings,
    linear_reader,
    lm_head,
    pre_ln_blocks,
)

H = "model.layers.{layer}"
_ATTENTION = tuple(linear_reader(f"self_attn.{p}_proj") for p in "qkv")
_MLP = tuple(linear_reader(f"mlp.{p}_proj", bias=False) for p in ("gate", "up"))
_HEAD = lm_head("model.norm", tied_to="model.embed_tokens.weight")


def _variant(config: dict) -> dict:
    if not config.get("use_parallel_residual", False):
        return {}
    blocks = pre_ln_blocks("model.layers", writes="{self_attn.o_proj|mlp.down_proj}",
                           input_layernorm=(*_ATTENTION, *_MLP))
    return {"norms": (*blocks.norms, *_HEAD.norms)}


STABLELM = assemble(
    "stablelm", "AutoModelForCausalLM",
    embeddings("model.embed_tokens.weight"),
    pre_ln_blocks("model.layers", writes="{self_attn.o_proj|mlp.down_proj}",
                  input_layernorm=_ATTENTION, post_attention_layernorm=_MLP),
    _HEAD,
    head_norms=tuple(HeadNorm(f"{H}.self_attn.{p}_layernorm.norms.{{head}}", f"{H}.self_attn.{p}_proj") for p in "qk"),
    variant=_variant,
    blocks="model.layers",
)
