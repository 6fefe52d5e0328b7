"""Adapters: one declarative ``Architecture`` per supported family, looked up by model type."""

from __future__ import annotations

from normswap.architectures.beit import BEIT
from normswap.architectures.biogpt import BIOGPT
from normswap.architectures.blenderbot import BLENDERBOT
from normswap.architectures.bloom import BLOOM
from normswap.architectures.clip import CLIP
from normswap.architectures.codegen import CODEGEN
from normswap.architectures.cohere import COHERE
from normswap.architectures.deit import DEIT
from normswap.architectures.dinov2 import DINOV2
from normswap.architectures.falcon import FALCON
from normswap.architectures.gpt2 import GPT2
from normswap.architectures.gpt_bigcode import GPT_BIGCODE
from normswap.architectures.gpt_neo import GPT_NEO
from normswap.architectures.gpt_neox import GPT_NEOX
from normswap.architectures.gptj import GPTJ
from normswap.architectures.m2m_100 import M2M_100
from normswap.architectures.mbart import MBART
from normswap.architectures.mpt import MPT
from normswap.architectures.nemotron import NEMOTRON
from normswap.architectures.olmo import OLMO
from normswap.architectures.opt import OPT
from normswap.architectures.pegasus import PEGASUS
from normswap.architectures.persimmon import PERSIMMON
from normswap.architectures.phi import PHI
from normswap.architectures.spec import (
    CENTRE_INPUT,
    CENTRE_OUTPUT,
    IDENTITY,
    STRUCTURE_KINDS,
    Architecture,
    EmbeddingNormBake,
    Norm,
    Reader,
    Writer,
)
from normswap.architectures.stablelm import STABLELM
from normswap.architectures.starcoder2 import STARCODER2
from normswap.architectures.vit import VIT
from normswap.architectures.whisper import WHISPER
from normswap.architectures.xglm import XGLM
from normswap.errors import NormswapError

ARCHITECTURES: dict[str, Architecture] = {}
for _architecture in (
    GPT2, WHISPER, VIT, CLIP, GPT_NEO, GPTJ, GPT_NEOX, OPT, BLOOM, PHI, FALCON, GPT_BIGCODE, CODEGEN,
    XGLM, BIOGPT, STARCODER2, STABLELM, PERSIMMON, MPT, OLMO, COHERE, NEMOTRON,
    M2M_100, MBART, PEGASUS, BLENDERBOT, DEIT, DINOV2, BEIT,
):
    for _model_type in _architecture.model_types:
        ARCHITECTURES[_model_type] = _architecture

_POST_LN_REASON = (
    "it is a post-LN model: its LayerNorms sit after the residual additions, so the norm output "
    "itself becomes the residual stream and mean removal cannot be moved into the weights; "
    "no exact RMSNorm conversion exists"
)
# model type -> why it cannot be converted exactly
POST_LN: dict[str, str] = {
    name: _POST_LN_REASON
    for name in ("bert", "roberta", "distilbert", "bart", "electra", "albert", "xlm-roberta",
                 "camembert", "deberta", "deberta-v2", "t5", "marian")
}
POST_LN["t5"] = "T5 already uses RMSNorm (T5LayerNorm); there is nothing to convert"


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(config: dict) -> Architecture:
    """The adapter for a checkpoint's config, or a NormswapError saying why there is none."""
    model_type = config.get("model_type")
    if model_type in POST_LN:
        raise NormswapError(f"cannot convert model type '{model_type}': {POST_LN[model_type]}")
    if model_type not in ARCHITECTURES:
        raise NormswapError(
            f"unsupported architecture '{model_type}'; supported: {', '.join(supported_model_types())}"
        )
    architecture = ARCHITECTURES[model_type]
    reason = architecture.refuse(config)
    if reason:
        raise NormswapError(f"cannot convert this {model_type} checkpoint exactly: {reason}")
    return architecture.for_config(config)


__all__ = [
    "ARCHITECTURES",
    "CENTRE_INPUT",
    "CENTRE_OUTPUT",
    "IDENTITY",
    "POST_LN",
    "STRUCTURE_KINDS",
    "Architecture",
    "EmbeddingNormBake",
    "Norm",
    "Reader",
    "Writer",
    "architecture_for",
    "supported_model_types",
]
