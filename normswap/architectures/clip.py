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

Commuting rotation (Q·1 = 1, stock LayerNorm kept): the text tower's stream is rotated, and
``final_layer_norm``'s γ folds into ``text_projection`` (β ⊘ γ stays in the norm, rotated), so the
projected text embeddings are exact while the text ``last_hidden_state`` comes out as (h ⊘ γ)·Q
(CLIPModel's ``text_model_output.pooler_output`` is the projection's output, exact). The vision stream is not rotated (``fixed_streams``): it starts as
``pre_layrnorm``'s γ ⊙ LN(e) + β, and no gain γ' makes γ' ⊙ LN(e·Q) equal (γ ⊙ LN(e))·Q unless γ
is constant (diag(γ) does not commute with Q), so the whole vision tower stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable

from normswap.architectures.facts import COMMON_RENAMES, ModelFacts, StateDict, Unstated, stated
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


VISION_FIXED = ("the vision stream starts as pre_layrnorm's output γ ⊙ LN(e) + β, and diag(γ) does not commute "
                "with Q")


def _fixed_streams(config: dict) -> dict[str, str]:
    kind = config.get("model_type")
    return {} if kind == "clip_text_model" else {"" if kind == "clip_vision_model" else r"vision_model\.": VISION_FIXED}


def _rotated_outputs(config: dict) -> dict[str, str]:
    if config.get("model_type") == "clip":
        # its text_model_output.pooler_output is the projection's output (transformers 5): exact
        return {"text_model_output.last_hidden_state": "text_model.final_layer_norm"}
    if config.get("model_type") == "clip_text_model":
        return {"last_hidden_state": "text_model.final_layer_norm"}
    return {}


def _drop_repeated(tower: str, scope: bool) -> tuple[str, str]:
    """transformers' renaming of a tower-prefixed key inside the tower module (a checkpoint saved
    from the other class layout): ``text_model.x`` -> ``x`` in the tower itself, or, where the
    tower is a submodule ``text_model``, ``text_model.text_model.x`` -> ``text_model.x``."""
    if scope:
        return rf"^{tower}_model\.{tower}_model\.(.+)", rf"{tower}_model.\1"
    return rf"^{tower}_model\.(.+)", r"\1"


def _encoder(state: StateDict, tower: str, config: dict) -> int:
    """The layers of one tower (``text_model.`` or ``vision_model.`` or ""), after its embeddings."""
    d, inner = stated(config, "hidden_size", size=True), stated(config, "intermediate_size", size=True)
    for layer in range(stated(config, "num_hidden_layers", size=True)):
        block = f"{tower}encoder.layers.{layer}"
        for projection in ("k_proj", "v_proj", "q_proj", "out_proj"):
            state.linear(f"{block}.self_attn.{projection}", d, d)
        state.layer_norm(block + ".layer_norm1", d).linear(block + ".mlp.fc1", d, inner)
        state.linear(block + ".mlp.fc2", inner, d).layer_norm(block + ".layer_norm2", d)
    return d


def _text(state: StateDict, tower: str, config: dict) -> int:
    d = stated(config, "hidden_size", size=True)
    state.add(tower + "embeddings.token_embedding", weight=(stated(config, "vocab_size", size=True), d))
    state.add(tower + "embeddings.position_embedding", weight=(stated(config, "max_position_embeddings", size=True), d))
    _encoder(state, tower, config)
    state.layer_norm(tower + "final_layer_norm", d)
    return d


def _vision(state: StateDict, tower: str, config: dict) -> int:
    d, patch = stated(config, "hidden_size", size=True), stated(config, "patch_size", size=True)
    patches = (stated(config, "image_size", size=True) // patch) ** 2
    state.add(tower + "embeddings", class_embedding=(d,))
    state.add(tower + "embeddings.patch_embedding", weight=(d, stated(config, "num_channels", size=True), patch, patch))
    state.add(tower + "embeddings.position_embedding", weight=(patches + 1, d)).layer_norm(tower + "pre_layrnorm", d)
    _encoder(state, tower, config)
    state.layer_norm(tower + "post_layernorm", d)
    return d


def _tower_facts(kind: str, projection: bool) -> Callable[[dict], ModelFacts]:
    """CLIPTextModel, CLIPVisionModel and their ``WithProjection`` forms."""
    build = _text if kind == "text" else _vision
    renames = (_drop_repeated(kind, scope=projection), *COMMON_RENAMES)

    def facts(config: dict) -> ModelFacts:
        if not projection:
            state = StateDict("clip", renames=renames)
            build(state, "", config)
            return state.facts()
        state = StateDict(f"{kind}_model", renames=renames)
        d = build(state, f"{kind}_model.", config)
        head = "text_projection" if kind == "text" else "visual_projection"
        return state.linear(head, d, stated(config, "projection_dim", size=True), bias=False).facts()

    return facts


def _model_facts(config: dict) -> ModelFacts:
    """CLIPModel: both towers under their prefixes, and the two projections."""
    text, vision = stated(config, "text_config"), stated(config, "vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise Unstated("text_config")
    projection = stated(config, "projection_dim", size=True)
    renames = (_drop_repeated("text", scope=True), _drop_repeated("vision", scope=True), *COMMON_RENAMES)
    state = StateDict("clip", renames=renames).add("", logit_scale=())
    text_width, vision_width = _text(state, "text_model.", text), _vision(state, "vision_model.", vision)
    state.linear("visual_projection", vision_width, projection, bias=False)
    return state.linear("text_projection", text_width, projection, bias=False).facts()


CLIP = assemble(
    ("clip", "clip_text_model", "clip_vision_model"), "AutoModel",
    embeddings(P + "embeddings.{token_embedding|position_embedding}.weight"),
    Writer(P + "embeddings.class_embedding", hidden_axis=0),
    Writer(P + "embeddings.patch_embedding.{weight|bias}", hidden_axis=0),
    pre_ln_blocks(P + "encoder.layers", writes="{self_attn.out_proj|mlp.fc2}",
                  layer_norm1=attention_readers("self_attn"), layer_norm2=linear_reader("mlp.fc1")),
    # read by text_projection (no bias) in the projecting classes; folded only by the commuting rotation
    Norm(P + "final_layer_norm", (linear_reader("text_projection", bias=False),), output_is_model_output=True),
    # its output is the residual stream: no reader to fold into; centred in the RMSNorm class
    Norm(P + "pre_layrnorm"),
    Norm(P + "post_layernorm", output_is_model_output=True),
    # older checkpoints store the position-id buffers, which current classes rebuild
    ignore=(pattern(P + "embeddings.position_ids"),),
    refuse=_refuse,
    structure=_structure,
    probe="clip",
    fixed_streams=_fixed_streams,
    rotated_outputs=_rotated_outputs,
    classes={"CLIPModel": _model_facts, "CLIPTextModel": _tower_facts("text", False),
             "CLIPTextModelWithProjection": _tower_facts("text", True),
             "CLIPVisionModel": _tower_facts("vision", False),
             "CLIPVisionModelWithProjection": _tower_facts("vision", True)},
    modality={"clip": "images"},
    calibration_tower={"clip": "text_model"},
)
