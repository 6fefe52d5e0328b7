"""CLIP, both towers: ``CLIPModel``, ``CLIPTextModel(WithProjection)``, ``CLIPVisionModel(WithProjection)``.

Both towers are pre-LN encoders with the same layer layout (``layer_norm1`` → q/k/v,
``layer_norm2`` → ``mlp.fc1``; ``self_attn.out_proj`` and ``mlp.fc2`` write).

Text tower: token and position embeddings write. Its ``final_layer_norm`` output is
``last_hidden_state`` (and, at the end-of-text token, the pooled output that ``text_projection``
reads): a model output, so its gains stay.

Vision tower: the patch-embedding conv (weight [d, C, p, p], hidden axis 0, no bias), the class
embedding [d] and the position table write the *input* of ``pre_layrnorm``. That norm's output,
γ ⊙ n + β, *is* the residual stream, and it is not zero-mean; no weight can fix that, because
centring γ ⊙ n is not a per-channel gain. So the RMSNorm class centres ``pre_layrnorm``'s output
explicitly (structure ``centre_output``; one mean per token). With its input centred by the
writers, ``pre_layrnorm`` itself is an exact RMSNorm. The stock LayerNorm class needs no centring:
there the stream carries a per-token mean that every later LayerNorm removes.
``post_layernorm`` gives the pooled output (read by ``visual_projection`` in CLIPModel), a model
output: gains stay.

Not exact: the vision tower's ``last_hidden_state`` is the raw residual stream, un-normalised.
Converting removes exactly its per-token mean component, so the converted model returns
C·h = h - mean(h)·1 where the original returns h (pooled outputs, embeddings and logits are exact).
``CLIPForImageClassification`` classifies that raw stream's token average, so it is refused.

In short: the vision stream is centred after ``pre_layrnorm`` in the RMSNorm class, and the
vision ``last_hidden_state`` is exact only up to its per-token mean.
"""

from normswap.architectures.spec import (
    CENTRE_OUTPUT,
    Norm,
    Writer,
    assemble,
    attention_readers,
    embeddings,
    linear_reader,
    pattern,
    pre_ln_blocks,
)

P = "{tower=text_model.|vision_model.|}"  # CLIPModel nests each tower under its prefix
UNSUPPORTED_CLASSES = {
    "CLIPForImageClassification": "its classifier reads the vision tower's raw residual stream, whose "
    "per-token mean an RMSNorm conversion must remove",
}


def _refuse(config: dict) -> str | None:
    for name in config.get("architectures") or []:
        if name in UNSUPPORTED_CLASSES:
            return f"{name}: {UNSUPPORTED_CLASSES[name]}"
    return None


def _structure(config: dict) -> dict[str, list[str]]:
    if config.get("model_type") == "clip_text_model":
        return {}
    return {CENTRE_OUTPUT: [pattern("{vision_model.|}pre_layrnorm")]}


CLIP = assemble(
    ("clip", "clip_text_model", "clip_vision_model"), "AutoModel",
    embeddings(P + "embeddings.{token_embedding|position_embedding}.weight"),
    Writer(P + "embeddings.class_embedding", hidden_axis=0),
    Writer(P + "embeddings.patch_embedding.{weight|bias}", hidden_axis=0),
    pre_ln_blocks(P + "encoder.layers", writes="{self_attn.out_proj|mlp.fc2}",
                  layer_norm1=attention_readers("self_attn"), layer_norm2=linear_reader("mlp.fc1")),
    Norm(P + "final_layer_norm", output_is_model_output=True),
    # its output is the residual stream: no reader to fold into; centred in the RMSNorm class
    Norm(P + "pre_layrnorm"),
    Norm(P + "post_layernorm", output_is_model_output=True),
    # older checkpoints store the position-id buffers, which current classes rebuild
    ignore=(pattern(P + "embeddings.position_ids"),),
    refuse=_refuse,
    structure=_structure,
    probe="clip",
)
