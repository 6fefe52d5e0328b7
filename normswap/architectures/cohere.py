"""Cohere (Command-R): a parallel block with one bias-free LayerNorm, optional per-head q/k norms.

The block computes x + attn(ln(x)) + mlp(ln(x)): ``input_layernorm`` (``CohereLayerNorm``, γ only)
is read by q/k/v_proj and the gated MLP's ``gate_proj``/``up_proj``. Writers: the token table,
``o_proj`` and ``down_proj``. ``logit_scale`` multiplies the logits and reads nothing.

``use_qk_norm``: ``q_norm``/``k_norm`` are CohereLayerNorms of shape [heads, head_dim] that
normalise each head's query and key over head_dim. Centring each head's rows of q_proj and
k_proj makes those inputs zero-mean, so they become RMSNorms exactly (``HeadNorm``), gains kept.
"""

from __future__ import annotations

from normswap.architectures.layouts import gated_mlp_readers, llama_layout
from normswap.architectures.spec import HeadNorm, assemble, attention_readers

H = "model.layers.{layer}"

COHERE = assemble(
    "cohere", "AutoModelForCausalLM",
    llama_layout(writes="{self_attn.o_proj|mlp.down_proj}",
                 input_layernorm=(*attention_readers("self_attn", rotary=True), *gated_mlp_readers("mlp"))),
    head_norms=tuple(HeadNorm(f"{H}.self_attn.{p}_norm", f"{H}.self_attn.{p}_proj") for p in "qk"),
    blocks="model.layers",
)
