"""Model classes for configs: which transformers class a checkpoint uses, built cheaply on meta."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from normswap.checkpoint.bounded import read_json
from normswap.errors import NormswapError

if TYPE_CHECKING:
    import transformers


def config_object(config: dict, *, trust_remote_code: bool = False) -> transformers.PretrainedConfig:
    """A transformers config object from a config.json dict."""
    import transformers

    data = dict(config)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise NormswapError("config.json has no model_type")
    if "auto_map" in data and not trust_remote_code and model_type not in transformers.CONFIG_MAPPING:
        raise NormswapError(
            f"model type '{model_type}' needs the checkpoint's own code; pass --trust-remote-code to run it"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as error:
        raise NormswapError(f"cannot build a config for model type '{model_type}': {error}") from None


def model_class(config: dict, default_auto_class: str) -> type:
    """The class named in ``architectures`` when transformers has it, else the family's Auto class.

    A class of another family (``BloomForCausalLM`` in a gpt2 config) is refused: it would be
    built from a config it cannot read.
    """
    import transformers

    model_type = str(config.get("model_type", ""))
    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            family = getattr(cls.config_class, "model_type", None)
            if family and model_type.removeprefix("normswap_") != family:
                raise NormswapError(f"config.json: 'architectures' names {name}, a {family} class, "
                                    f"but 'model_type' is {model_type}")
            return cls
    return getattr(transformers, default_auto_class)


def class_names(config: dict, default_auto_class: str) -> tuple[str, str]:
    """(model class name, config class name) that ``meta_model`` would build for ``config``, read
    from transformers' tables without building the model.

    The names come from the Auto classes' model-type tables when those settle them (every name
    there is a class of that model type), so the family's modeling code is not imported: for
    GPT-2 that import alone costs seconds. A name the tables do not place is looked up as
    ``model_class`` looks it up."""
    names = _names_from_tables(config, default_auto_class)
    return names if names is not None else names_from_classes(config, default_auto_class)


def names_from_classes(config: dict, default_auto_class: str) -> tuple[str, str]:
    """``class_names`` from the classes themselves (``model_class``), importing their code."""
    import transformers

    cls = model_class(config, default_auto_class)
    model_type = config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise NormswapError(f"cannot build a config for model type '{model_type}'")
    config_class = transformers.CONFIG_MAPPING[model_type]
    if cls.__name__.startswith("Auto"):
        try:
            cls = cls._model_mapping[config_class]
        except KeyError:
            raise NormswapError(f"transformers' {cls.__name__} has no class for model type '{model_type}'") from None
    return cls.__name__, config_class.__name__


def _names_from_tables(config: dict, default_auto_class: str) -> tuple[str, str] | None:
    """``class_names`` from the tables alone, or None when they do not settle it: an
    ``architectures`` entry that no table lists under this model type (another family's class,
    or a class no Auto class maps) is left to ``model_class``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return None
    own = set()
    for table in _auto_model_tables().values():
        entry = table.get(model_type)
        own.update([entry] if isinstance(entry, str) else entry if isinstance(entry, (list, tuple)) else [])
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        return None
    if architectures:
        first = architectures[0]
        return (first, CONFIG_MAPPING_NAMES[model_type]) if isinstance(first, str) and first in own else None
    auto = _auto_model_tables().get(default_auto_class, {}).get(model_type)
    if isinstance(auto, (list, tuple)):
        auto = auto[0] if auto else None
    return (auto, CONFIG_MAPPING_NAMES[model_type]) if isinstance(auto, str) else None


def meta_model(config: dict, default_auto_class: str) -> nn.Module:
    """The family's model on the meta device: names and module types, no memory."""
    cls = model_class(config, default_auto_class)
    config_obj = config_object(config)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cls.__name__.startswith("Auto"):
            return cls.from_config(config_obj)
        return cls(config_obj)


def checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """transformers' load-time renaming of checkpoint keys for ``model``'s class, as name -> name.

    transformers 5 renames some families' keys when loading (ViT's legacy
    ``encoder.layer.0.attention.attention.query`` becomes ``layers.0.attention.q_proj``; an old
    ``CLIPVisionModel`` checkpoint's ``vision_model.`` prefix is dropped). The plan applies the same
    renaming so that adapters see the class's own names. Converters that merge or split tensors
    are not renamings and are left out: a checkpoint that needs them fails the adapter's coverage
    checks instead of being converted wrongly. Identity when transformers offers no such API.
    The renamings are looked up at the first call: building transformers' table of them costs
    a few tenths of a second, which a checkpoint holding only the class's own names never needs
    (``canonical_names`` keeps those without renaming).
    """

    @functools.cache
    def renamings() -> tuple[list, Callable] | None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, rename_source_key

            transforms = get_model_conversion_mapping(model)
        except Exception:  # another transformers version: no renaming layer to mirror
            return None
        return [transform for transform in transforms if not isinstance(transform, WeightConverter)], rename_source_key

    def rename(name: str) -> str:
        found = renamings()
        if found is None:
            return name
        transforms, rename_source_key = found
        return rename_source_key(name, transforms, [])[0]

    return rename


def auto_classes_for(model_type: str, class_name: str) -> list[str]:
    """Names of the transformers Auto classes that map ``model_type`` to ``class_name``.

    A converted ``ViTForImageClassification`` should load as RMSNorm model through
    ``AutoModelForImageClassification`` too, not only through its family's ``AutoModel``.
    """
    names = []
    for name, table in _auto_model_tables().items():
        target = table.get(model_type)
        if target == class_name or (isinstance(target, (list, tuple)) and class_name in target):
            names.append(name)
    return names


@functools.cache
def _auto_model_tables() -> dict[str, dict]:
    """Auto class name -> its model-type -> class-name table, from the module that defines the
    Auto classes (listing ``dir(transformers)`` instead costs ~0.3 s)."""
    from transformers.models.auto import modeling_auto

    tables = {}
    for name, value in vars(modeling_auto).items():
        if name.startswith("AutoModel"):
            mapping = getattr(value, "_model_mapping", None)
            table = getattr(mapping, "_model_mapping", None)
            if isinstance(table, dict):
                tables[name] = table
    return tables


def layer_norm_modules(model: nn.Module) -> list[str]:
    """Qualified names of every ``nn.LayerNorm`` in ``model``."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)]


def load_pretrained(cls: type, path: Path | str, **kwargs) -> nn.Module:
    """``cls.from_pretrained`` with transformers' load-time chatter silenced, in eval mode.

    config.json is built first, so that a config transformers rejects is one line; and a
    checkpoint lacking a weight the class has, or holding one of another shape, is refused
    rather than run with those weights at random values.
    """
    from transformers.utils import logging as hf_logging

    _check_index_metadata(Path(path))
    config_class = getattr(cls, "config_class", None)
    if isinstance(config_class, type) and "config" not in kwargs:
        kwargs["config"] = _built_config(config_class, path)
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = cls.from_pretrained(str(path), output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except LookupError as error:  # the structure is resolved on the model as it is built (remote.UnknownModule,
        if type(error).__name__ != "UnknownModule":  # or the checkpoint's own copy of it under remote code)
            raise
        raise NormswapError(f"{Path(path) / 'config.json'}: {error}") from None
    except ValueError as error:  # the RMSNorm class refuses a record it cannot run (remote.online_hadamard_factor)
        if not str(error).startswith("online_hadamard:"):
            raise
        raise NormswapError(f"{Path(path) / 'config.json'}: normswap.rotation.{error}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    for key, ours, theirs in sorted(info.get("mismatched_keys") or [])[:1]:
        raise NormswapError(f"{path}: tensor {key} has shape {list(ours)}, but the model that config.json describes "
                            f"needs {list(theirs)}")
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would run the model with these weights at random values
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise NormswapError(f"{path}: the weights hold no tensor {missing[0]}{more}, which the model that config.json "
                            "describes needs; it would start from random values")
    return model.eval()


def _check_index_metadata(folder: Path) -> None:
    """transformers' loader reads an index's ``metadata`` as a mapping (normswap's own reader does not
    need it): refuse, before loading, an index that has none."""

    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / name).is_file() and not isinstance(read_json(folder / name).get("metadata"), dict):
            raise NormswapError(f"{folder / name}: 'metadata' must be a mapping; transformers cannot load an index "
                                "without one (an empty {} will do)")


def _built_config(config_class: type, path: Path | str) -> transformers.PretrainedConfig:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return config_class.from_pretrained(str(path))
    except Exception as error:  # transformers' validators raise many types for a value they reject
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise NormswapError(f"{Path(path) / 'config.json'}: transformers rejects it: {reason}") from None
