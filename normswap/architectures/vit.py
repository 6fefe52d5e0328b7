"""ViT (``ViTModel``, ``ViTForImageClassification``): a pre-LN vision encoder.

Names are transformers 5's (``layers.N.attention.q_proj``); checkpoints in the legacy layout
(``encoder.layer.N.attention.attention.query``) are renamed on reading, as transformers does.

Writers: the patch-embedding conv (weight [d, C, p, p] and bias [d], hidden axis 0), the class
token and the position table ([1, n, d], hidden axis 2; interpolating centred positions keeps them
centred), the optional mask token, and every ``attention.o_proj`` and ``mlp.fc2``.

The final ``layernorm``: in ``ViTModel`` its output is ``last_hidden_state`` (and feeds the
pooler), a model output, so its gains stay; in ``ViTForImageClassification`` only the classifier
(which has a bias) reads it, so γ and β fold there.

Commuting rotation (Q·1 = 1, stock LayerNorm kept): the whole stream is rotated. In
``ViTForImageClassification`` the logits are exact. In ``ViTModel`` the final ``layernorm``'s γ
and β fold into ``pooler.dense`` (which reads the class token), so ``pooler_output`` is exact and
``last_hidden_state`` comes out as ((h - β) ⊘ γ)·Q for the original's h.
"""

from __future__ import annotations

from normswap.architectures.facts import COMMON_RENAMES, ModelFacts, StateDict, Unstated, stated
from normswap.architectures.layouts import vit_encoder
from normswap.architectures.spec import Norm, assemble, linear_reader, only_classes

P = "{base=vit.|}"  # ViTForImageClassification nests the encoder under ``vit.``
SUPPORTED_CLASSES = ("ViTModel", "ViTForImageClassification")

# transformers 5 renames the legacy layout on load (before the renamings every class gets)
_RENAMES = ((r"encoder\.layer\.", "layers."), ("attention.query", "q_proj"), ("attention.key", "k_proj"),
            ("attention.value", "v_proj"), ("attention.output.dense", "attention.o_proj"),
            ("intermediate.dense", "mlp.fc1"), ("output.dense", "mlp.fc2"), *COMMON_RENAMES)


def _facts(config: dict, *, classifier: bool) -> ModelFacts:
    """ViTModel (with its pooler) or ViTForImageClassification (no pooler, a classifier), as
    ViTEmbeddings and ViTLayer build them; every size must be stated."""
    d = stated(config, "hidden_size", size=True)
    patches = (stated(config, "image_size", size=True) // stated(config, "patch_size", size=True)) ** 2
    inner, bias = stated(config, "intermediate_size", size=True), stated(config, "qkv_bias", True)
    if "num_labels" in config or stated(config, "use_mask_token", False):
        raise Unstated("num_labels")
    top = "vit." if classifier else ""
    state = StateDict("vit", renames=_RENAMES).add(top + "embeddings", cls_token=(1, 1, d), position_embeddings=(1, patches + 1, d))
    state.add(top + "embeddings.patch_embeddings.projection", weight=(d, stated(config, "num_channels", size=True),
                                                                       *(2 * [stated(config, "patch_size")])), bias=(d,))
    for layer in range(stated(config, "num_hidden_layers", size=True)):
        block = f"{top}layers.{layer}"
        for projection in ("q_proj", "k_proj", "v_proj"):
            state.linear(f"{block}.attention.{projection}", d, d, bias=bias)
        state.linear(block + ".attention.o_proj", d, d).layer_norm(block + ".layernorm_before", d)
        state.layer_norm(block + ".layernorm_after", d).linear(block + ".mlp.fc1", d, inner).linear(block + ".mlp.fc2", inner, d)
    state.layer_norm(top + "layernorm", d)
    if not classifier:
        return state.linear("pooler.dense", d, stated(config, "pooler_output_size", None) or d).facts()
    labels = len(stated(config, "id2label", {0: 0, 1: 1}))
    return (state.linear("classifier", d, labels) if labels else state).facts()


VIT = assemble(
    "vit", "AutoModel",
    vit_encoder(P + "embeddings", P + "layers", tokens="{cls_token|mask_token|position_embeddings}"),
    # ViTModel: last_hidden_state itself, and the pooler's input (folded by the commuting rotation only)
    Norm("layernorm", (linear_reader("pooler.dense"),), output_is_model_output=True),
    # ViTForImageClassification: read only by the classifier (on the class token)
    Norm("vit.layernorm", (linear_reader("classifier"),)),
    refuse=only_classes(*SUPPORTED_CLASSES),
    probe="vision",
    rotated_outputs=lambda config: {"last_hidden_state": "layernorm"},
    classes={"ViTModel": lambda config: _facts(config, classifier=False),
             "ViTForImageClassification": lambda config: _facts(config, classifier=True)},
    modality="images",
)
