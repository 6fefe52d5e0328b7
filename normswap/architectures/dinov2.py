"""DINOv2 (``Dinov2Model``): a pre-LN vision encoder whose writes are scaled by LayerScale.

Each block adds λ₁ ⊙ attn(norm1(x)) and λ₂ ⊙ mlp(norm2(x)). λ folds into the writer it scales
(``LayerScale``: W' = diag(λ)·W, b' = λ ⊙ b) before the writer is centred, so the scaled write is
orthogonal to 1. Writers: the patch conv, the class token and position table ([1, n, d]), the
mask token ([1, d]), ``attention.o_proj`` and ``mlp.fc2``. The final ``layernorm`` gives ``last_hidden_state``: a model output.

Only ``Dinov2Model`` is accepted: the classifier reads the class token and the patch-token mean
side by side (a [labels, 2d] weight), which the adapter does not describe. The SwiGLU MLP is
refused: checkpoints store it fused, and transformers splits it on load (a split, not a renaming).
"""

from __future__ import annotations

from normswap.architectures.layouts import vit_encoder
from normswap.architectures.spec import LayerScale, Norm, Writer, assemble, only_classes

H = "encoder.layer.{layer}"


_ONLY = only_classes("Dinov2Model")


def _refuse(config: dict) -> str | None:
    if config.get("use_swiglu_ffn"):
        return ("use_swiglu_ffn: checkpoints store the SwiGLU MLP fused (mlp.weights_in), which transformers "
                "splits into gate_proj/up_proj on load; normswap follows renamings only, not splits")
    return _ONLY(config)


DINOV2 = assemble(
    "dinov2", "AutoModel",
    Writer("embeddings.mask_token", hidden_axis=1),
    vit_encoder("embeddings", "encoder.layer", tokens="{cls_token|position_embeddings}", norms=("norm1", "norm2")),
    Norm("layernorm", output_is_model_output=True),
    # the MLP's writer is fc2 or, with the SwiGLU MLP, weights_out (as checkpoints store it): whichever the checkpoint has
    layer_scales=(LayerScale(H + ".layer_scale1.lambda1", H + ".attention.o_proj"),
                  LayerScale(H + ".layer_scale2.lambda1", H + ".mlp.fc2")),
    refuse=_refuse,
    probe="vision",
    modality="images",
)
