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
"""

from normswap.architectures.spec import LINEAR_IN_AXIS, LINEAR_OUT_AXIS, Architecture, Norm, Reader, Writer

P = r"(?P<p>((text|vision)_model\.)?)"
LAYER = P + r"encoder\.layers\.(?P<layer>\d+)"
UNSUPPORTED_CLASSES = {
    "CLIPForImageClassification": "its classifier reads the vision tower's raw residual stream, whose "
    "per-token mean an RMSNorm conversion must remove",
}


def _linear(name: str, constant_cancels: bool = False) -> Reader:
    prefix = "{p}encoder.layers.{layer}." + name
    return Reader(prefix + ".weight", LINEAR_IN_AXIS, prefix + ".bias", constant_cancels=constant_cancels)


def _refuse(config: dict) -> str | None:
    for name in config.get("architectures") or []:
        if name in UNSUPPORTED_CLASSES:
            return f"{name}: {UNSUPPORTED_CLASSES[name]}"
    return None


def _structure(config: dict) -> dict[str, list[str]]:
    if config.get("model_type") == "clip_text_model":
        return {}
    return {"centre_output": [r"(vision_model\.)?pre_layrnorm"]}


CLIP = Architecture(
    model_types=("clip", "clip_text_model", "clip_vision_model"),
    auto_class="AutoModel",
    writers=(
        Writer(P + r"embeddings\.(token_embedding|position_embedding)\.weight", hidden_axis=1),
        Writer(P + r"embeddings\.class_embedding", hidden_axis=0),
        Writer(P + r"embeddings\.patch_embedding\.(weight|bias)", hidden_axis=0),
        Writer(LAYER + r"\.(self_attn\.out_proj|mlp\.fc2)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(LAYER + r"\.(self_attn\.out_proj|mlp\.fc2)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(LAYER + r"\.layer_norm1", (
            _linear("self_attn.q_proj"), _linear("self_attn.k_proj", constant_cancels=True), _linear("self_attn.v_proj"),
        )),
        Norm(LAYER + r"\.layer_norm2", (_linear("mlp.fc1"),)),
        Norm(P + r"final_layer_norm", output_is_model_output=True),
        # its output is the residual stream: no reader to fold into; centred in the RMSNorm class
        Norm(P + r"pre_layrnorm"),
        Norm(P + r"post_layernorm", output_is_model_output=True),
    ),
    # older checkpoints store the position-id buffers, which current classes rebuild
    ignore=(P + r"embeddings\.position_ids",),
    refuse=_refuse,
    structure=_structure,
    probe="clip",
    notes="vision stream centred after pre_layrnorm in the RMSNorm class; vision last_hidden_state "
    "exact only up to its per-token mean",
)
