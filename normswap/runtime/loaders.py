"""The ways a converted checkpoint is loaded for verification, and the loop over them.

A converted checkpoint is run the ways a user would load it: with stock transformers' class (the
LayerNorm model on centred weights; only when stock transformers accepts its config) and as the
RMSNorm model, built from normswap's own classes (``rmsnorm``) or, with consent, from the
checkpoint's own ``modeling_normswap.py`` (``remote``, which runs that file).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from normswap.architectures import Architecture, architecture_for
from normswap.checkpoint.provenance import family_config
from normswap.checkpoint.source import read_config
from normswap.errors import NormswapError
from normswap.memory import release_memory
from normswap.modeling import build, online


def rmsnorm_class(path: Path, architecture: Architecture, config: dict | None = None) -> type:
    """The RMSNorm class for a converted checkpoint, from the modeling code installed with normswap.

    This is the class the checkpoint's ``modeling_normswap.py`` defines (the file is a copy of
    ``normswap.modeling.remote``), taken from normswap itself so that nothing in the checkpoint runs.
    ``config`` is the checkpoint's config.json when the caller has read it.
    """
    from normswap.modeling import remote

    config = read_config(path) if config is None else config
    online.check_config(config, architecture.auto_class, path)
    base = build.model_class(config, architecture.auto_class)
    if base.__name__.startswith("Auto"):
        raise NormswapError(f"{path / 'config.json'}: 'architectures' names no model class this transformers has")
    own_type = str(config.get("model_type", "")).startswith(remote.MODEL_TYPE_PREFIX)
    # remote's module __getattr__ is how transformers resolves auto_map names; use the same door
    return getattr(remote, (remote.OWN_TYPE_PREFIX if own_type else remote.CLASS_PREFIX) + base.__name__)


def load_converted(path: Path, how: str, *, dtype: torch.dtype = torch.float32,
                   config: dict | None = None) -> nn.Module:
    """Load a converted checkpoint with stock transformers (``stock``), normswap's RMSNorm classes
    (``rmsnorm``), or the checkpoint's own ``modeling_normswap.py`` (``remote``, runs its code).

    The stock path uses the class named in ``architectures`` (a ``ViTForImageClassification``
    must not load as the family Auto class's ``ViTModel``); the remote path goes through the
    family's Auto class, whose ``auto_map`` entry names the RMSNorm form of that same class.
    """
    from normswap.modeling.registry import register_auto_classes

    register_auto_classes()  # a normswap_<type> config must resolve, as after ``import normswap``
    config = read_config(path) if config is None else config
    architecture = architecture_for(family_config(config))
    if how == "stock":
        return build.load_pretrained(build.model_class(config, architecture.auto_class), path, dtype=dtype)
    if how == "rmsnorm":
        return build.load_pretrained(rmsnorm_class(path, architecture, config), path, dtype=dtype)
    if how == "remote":
        import transformers

        online.check_config(config, architecture.auto_class, path)
        auto = getattr(transformers, architecture.auto_class)
        return build.load_pretrained(auto, path, dtype=dtype, trust_remote_code=True)
    raise ValueError(how)


def stock_refuses(path: Path, config: dict | None = None) -> bool:
    """True when stock transformers refuses to load ``path`` without trust_remote_code.

    Trying a load in this process proves nothing: ``import normswap`` registers the
    ``normswap_<type>`` model types with the Auto classes, so the load would succeed. Stock
    transformers on its own knows only its built-in model types, and refuses any other one.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return (read_config(path) if config is None else config).get("model_type") not in CONFIG_MAPPING_NAMES


def refusals(path: Path, stock_loadable: bool, config: dict | None = None) -> dict[str, dict]:
    """The loaders that must refuse ``path``, and whether they do: stock transformers, when the
    conversion is not meant to load with it."""
    return {} if stock_loadable else {"stock": {"refused": stock_refuses(path, config)}}


def loader_runs(stock_loadable: bool, rms_how: str | None) -> list[tuple[str, str]]:
    """(label, how) for each load of a converted checkpoint: ``stock`` (when ``stock_loadable``),
    then ``rms_how`` as ``remote_code`` (none when ``rms_how`` is None: no RMSNorm class computes it)."""
    return ([("stock", "stock")] if stock_loadable else []) + ([("remote_code", rms_how)] if rms_how else [])


def checked_form(how: str, model: nn.Module) -> nn.Module:
    """``model``, once it is known to be the form ``how`` names: the RMSNorm model must have no LayerNorm left."""
    if how != "stock" and any(isinstance(module, nn.LayerNorm) for module in model.modules()):
        raise NormswapError("the RMSNorm model still has nn.LayerNorm modules")
    return model


def each_loader(stock_loadable: bool, rms_how: str | None, load: Callable[[str], nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """(label, model) for each load of the converted checkpoint (``loader_runs``), one at a time:
    ``load(how)``, checked (``checked_form``). Each model is dropped, and its memory handed back,
    before the next is loaded: the caller keeps no reference to it past its turn."""
    for label, how in loader_runs(stock_loadable, rms_how):
        model = checked_form(how, load(how))
        yield label, model
        del model
        release_memory()
