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
    Norm,
    Writer,
    assemble,
    attention_readers,
    linear_reader,
    only_classes,
    pre_ln_blocks,
)

P = "{base=vit.|}"  # ViTForImageClassification nests the encoder under ``vit.``
SUPPORTED_CLASSES = ("ViTModel", "ViTForImageClassification")

VIT = assemble(
    "vit", "AutoModel",
    Writer(P + "embeddings.{cls_token|mask_token|position_embeddings}", hidden_axis=2),
    Writer(P + "embeddings.patch_embeddings.projection.{weight|bias}", hidden_axis=0),
    pre_ln_blocks(P + "layers", writes="{attention.o_proj|mlp.fc2}",
                  layernorm_before=attention_readers("attention"), layernorm_after=linear_reader("mlp.fc1")),
    # ViTModel: last_hidden_state itself
    Norm("layernorm", output_is_model_output=True),
    # ViTForImageClassification: read only by the classifier (on the class token)
    Norm("vit.layernorm", (linear_reader("classifier"),)),
    refuse=only_classes(*SUPPORTED_CLASSES),
    probe="vision",
)
