"""BEiT (``BeitForImageClassification`` with mean pooling): pre-LN blocks scaled by LayerScale.

Each block adds λ₁ ⊙ attn(layernorm_before(x)) and λ₂ ⊙ mlp(layernorm_after(x)); λ (``lambda_1``,
``lambda_2``) folds into ``attention.o_proj`` and ``mlp.fc2`` before they are centred
(``LayerScale``). Writers: the patch conv, the class token, the optional mask token and position
table. Keys have no bias: a norm's β folded through ``k_proj`` would add a constant to every key,
which softmax cancels (relative position biases are added to the scores, not the keys). The
pooler's ``layernorm`` reads the mean of the patch tokens' stream (a mean of centred vectors is
centred) and only the classifier reads it, so its γ and β fold there.

Refused: ``use_mean_pooling`` false (the final norm then feeds the pooled output the classifier
reads differently), and the other classes, whose ``last_hidden_state`` is the raw stream.
"""

from __future__ import annotations

from normswap.architectures.layouts import vit_encoder
from normswap.architectures.spec import LayerScale, Norm, assemble, linear_reader, only_classes

H = "beit.layers.{layer}"
_ONLY = only_classes("BeitForImageClassification")


def _refuse(config: dict) -> str | None:
    if not config.get("use_mean_pooling", True):
        return "use_mean_pooling=false: only the mean-pooled classifier is described"
    return _ONLY(config)


BEIT = assemble(
    "beit", "AutoModelForImageClassification",
    vit_encoder("beit.embeddings", "beit.layers", tokens="{cls_token|mask_token|position_embeddings}", key_bias=False),
    Norm("beit.pooler.layernorm", (linear_reader("classifier"),)),
    layer_scales=(LayerScale(H + ".lambda_1", H + ".attention.o_proj"), LayerScale(H + ".lambda_2", H + ".mlp.fc2")),
    refuse=_refuse,
    probe="vision",
    modality="images",
)
