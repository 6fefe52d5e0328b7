"""DeiT: ViT's pre-LN encoder with a distillation token (``DeiTModel``, ``DeiTForImageClassification``,
``DeiTForImageClassificationWithTeacher``).

Writers: the patch-embedding conv, the class and distillation tokens, the position table and the
optional mask token ([1, n, d], hidden axis 2), every ``attention.o_proj`` and ``mlp.fc2``. The
final ``layernorm``: in ``DeiTModel`` its output is ``last_hidden_state``, a model output (gains
stay); in the classifiers only the heads read it (at the class and distillation tokens), with
biases, so γ and β fold there.
"""

from __future__ import annotations

from normswap.architectures.spec import (
    Norm,
    Writer,
    assemble,
    attention_readers,
    linear_reader,
    only_classes,
    pre_ln_blocks,
)

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
    Writer(P + "embeddings.{cls_token|distillation_token|mask_token|position_embeddings}", hidden_axis=2),
    Writer(P + "embeddings.patch_embeddings.projection.{weight|bias}", hidden_axis=0),
    pre_ln_blocks(P + "layers", writes="{attention.o_proj|mlp.fc2}",
                  layernorm_before=attention_readers("attention"), layernorm_after=linear_reader("mlp.fc1")),
    Norm("layernorm", output_is_model_output=True),
    Norm("deit.layernorm", (linear_reader("classifier"),)),
    refuse=only_classes("DeiTModel", "DeiTForImageClassification", TEACHER),
    variant=_variant,
    probe="vision",
)
