"""DeiT: ViT's pre-LN encoder with a distillation token (``DeiTModel``, ``DeiTForImageClassification``,
``DeiTForImageClassificationWithTeacher``).

Writers: the patch-embedding conv, the class and distillation tokens, the position table and the
optional mask token ([1, n, d], hidden axis 2), every ``attention.o_proj`` and ``mlp.fc2``. The
final ``layernorm``: in ``DeiTModel`` its output is ``last_hidden_state``, a model output (gains
stay); in the classifiers only the heads read it (at the class and distillation tokens), with
biases, so γ and β fold there.
"""

from __future__ import annotations

from normswap.architectures.layouts import vit_encoder
from normswap.architectures.spec import Norm, assemble, linear_reader, only_classes

P = "{base=deit.|}"
TEACHER = "DeiTForImageClassificationWithTeacher"


def _variant(config: dict) -> dict:
    """The classifier with a teacher reads the final norm with two heads, at two tokens."""
    if TEACHER not in (config.get("architectures") or []):
        return {}
    heads = Norm("deit.layernorm", tuple(linear_reader(head) for head in ("cls_classifier", "distillation_classifier")))
    return {"norms": (*DEIT.norms[:-1], heads)}

DEIT = assemble(
    "deit", "AutoModel",
    vit_encoder(P + "embeddings", P + "layers", tokens="{cls_token|distillation_token|mask_token|position_embeddings}"),
    Norm("layernorm", output_is_model_output=True),
    Norm("deit.layernorm", (linear_reader("classifier"),)),
    refuse=only_classes("DeiTModel", "DeiTForImageClassification", TEACHER),
    variant=_variant,
    probe="vision",
    modality="images",
)
