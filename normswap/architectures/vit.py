"""ViT (``ViTModel``, ``ViTForImageClassification``): a pre-LN vision encoder.

Names are transformers 5's (``layers.N.attention.q_proj``); checkpoints in the legacy layout
(``encoder.layer.N.attention.attention.query``) are renamed on reading, as transformers does.

Writers: the patch-embedding conv (weight [d, C, p, p] and bias [d], hidden axis 0), the class
token and the position table ([1, n, d], hidden axis 2; interpolating centred positions keeps them
centred), the optional mask token, and every ``attention.o_proj`` and ``mlp.fc2``.

The final ``layernorm``: in ``ViTModel`` its output is ``last_hidden_state`` (and feeds the
pooler), a model output, so its gains stay; in ``ViTForImageClassification`` only the classifier
(which has a bias) reads it, so γ and β fold there.
"""

from normswap.architectures.spec import (
    LINEAR_IN_AXIS,
    LINEAR_OUT_AXIS,
    Architecture,
    Norm,
    Reader,
    Writer,
    only_classes,
)

P = r"(?P<p>(vit\.)?)"
LAYER = P + r"layers\.(?P<layer>\d+)"
SUPPORTED_CLASSES = ("ViTModel", "ViTForImageClassification")


def _linear(name: str, constant_cancels: bool = False) -> Reader:
    prefix = "{p}layers.{layer}." + name
    return Reader(prefix + ".weight", LINEAR_IN_AXIS, prefix + ".bias", constant_cancels=constant_cancels)



VIT = Architecture(
    model_types=("vit",),
    auto_class="AutoModel",
    writers=(
        Writer(P + r"embeddings\.(cls_token|mask_token|position_embeddings)", hidden_axis=2),
        Writer(P + r"embeddings\.patch_embeddings\.projection\.(weight|bias)", hidden_axis=0),
        Writer(LAYER + r"\.(attention\.o_proj|mlp\.fc2)\.weight", hidden_axis=LINEAR_OUT_AXIS),
        Writer(LAYER + r"\.(attention\.o_proj|mlp\.fc2)\.bias", hidden_axis=0),
    ),
    norms=(
        Norm(LAYER + r"\.layernorm_before", (
            _linear("attention.q_proj"), _linear("attention.k_proj", constant_cancels=True), _linear("attention.v_proj"),
        )),
        Norm(LAYER + r"\.layernorm_after", (_linear("mlp.fc1"),)),
        # ViTModel: last_hidden_state itself
        Norm(r"layernorm", output_is_model_output=True),
        # ViTForImageClassification: read only by the classifier (on the class token)
        Norm(r"vit\.layernorm", (Reader("classifier.weight", LINEAR_IN_AXIS, "classifier.bias"),)),
    ),
    refuse=only_classes(*SUPPORTED_CLASSES),
    probe="vision",
)
