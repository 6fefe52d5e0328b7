"""Adapters: one declarative ``Architecture`` per supported family, looked up by model type.

Every module here but the shared ones below is one family's adapter, found by
``discovered_architectures``: adding a family is adding its module.

- ``spec``: the ``Architecture`` record and the pieces adapters are written in.
- ``layouts``: the layouts several families share (Llama, GPT-2, Megatron-LM, BART, ViT names).
- ``facts``: what planning needs to know about a family's model class, as data.
- ``seq2seq``: the BART-lineage text encoder-decoders, built alike.
"""

from __future__ import annotations

import importlib
import pkgutil

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
from normswap.errors import NormswapError

# the package's modules that describe no family: the vocabulary adapters are written in
SHARED_MODULES = frozenset({"spec", "layouts", "facts", "seq2seq"})


def discovered_architectures() -> dict[str, Architecture]:
    """Model type -> adapter, from every public ``Architecture`` each adapter module of this
    package defines: adding a family is adding its module. A model type claimed twice is a bug."""
    found: dict[str, Architecture] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if module_info.name in SHARED_MODULES or module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, Architecture) and not name.startswith("_"):
                for model_type in value.model_types:
                    if found.setdefault(model_type, value) is not value:
                        raise RuntimeError(f"model type {model_type} has two adapters ({module_info.name}.{name})")
    return found


ARCHITECTURES: dict[str, Architecture] = discovered_architectures()

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
