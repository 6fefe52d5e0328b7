"""Planning a conversion: the adapter for a checkpoint, and its plan, checked against the model
class, before any weight is read.

Torch-free as far as the adapter allows: a class whose facts the adapter declares
(``normswap.architectures.facts``) is not built, so ``inspect`` imports neither torch nor
transformers; an undeclared class is built on the meta device.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from normswap.architectures import Architecture, architecture_for
from normswap.architectures.facts import ModelFacts, facts_of_model
from normswap.checkpoint import validation
from normswap.checkpoint.source import CheckpointReader
from normswap.convert.plan import ClassNames, ConversionPlan, build_plan
from normswap.errors import NormswapError

if TYPE_CHECKING:
    import torch
    from torch import nn


def check_convertible(source_dir: Path, config: dict) -> Architecture:
    """The adapter for ``config``, or a NormswapError saying why the checkpoint cannot be converted."""
    if "normswap" in config:
        raise NormswapError(f"{source_dir} was already converted by normswap; convert the original instead")
    validation.check_config(config, f"{source_dir / 'config.json'}")
    return architecture_for(config)


def plan_conversion(
    source_dir: Path, config: dict, reader: CheckpointReader, *, method: str, fold_gains: bool,
    dtype: torch.dtype | None, architecture: Architecture | None = None, build_class: bool = True,
) -> tuple[Architecture, ConversionPlan, nn.Module | None]:
    """The adapter, the plan, and the family's model built on the meta device (it names the
    output's classes).

    ``architecture`` is the adapter ``check_convertible`` returned; without it the check runs here.
    With ``build_class`` False, a class whose facts the adapter declares is not built (no torch,
    no transformers: what ``inspect`` needs) and the model returned is None; an undeclared class,
    or a config whose declaration is unsure (``facts.Unstated``), is built as always. ``convert``
    and the rebuilt plan of ``verify`` plan this way; ``tests/test_model_facts.py`` holds every
    declaration equal to its class (LayerNorm modules included).
    """
    if architecture is None:
        architecture = check_convertible(source_dir, config)
    where = f"{source_dir / 'config.json'}"
    validation.check_layer_count(config, reader.tensors, where)  # before building thousands of layers
    facts = None if build_class else architecture.facts(config)
    meta = None
    if facts is None:
        from normswap.modeling import build

        meta = build.meta_model(config, architecture.auto_class)
        facts = facts_of_model(meta)
        names = ClassNames.of_facts(facts, build.checkpoint_renamer(meta), [name for name, _ in meta.named_modules()])
    else:
        names = ClassNames.of_facts(facts)
    read_small = reader.read_array if meta is None and hasattr(reader, "read_array") else reader.get
    plan = build_plan(architecture, config, reader.tensors, names, method=method, fold_gains=fold_gains,
                      dtype=dtype, read_small=read_small)
    check_shapes(plan, facts, where)
    return architecture, plan, meta


def check_shapes(plan: ConversionPlan, facts: ModelFacts, where: str) -> None:
    """Refuse weights whose shapes are not the ones the config implies for the model class."""
    for name, tensor in plan.tensors.items():
        implied = facts.tensors.get(name)
        if implied is not None and implied != tuple(tensor.shape):
            raise NormswapError(f"tensor {tensor.source} has shape {list(tensor.shape)}, but {where} implies "
                                f"{list(implied)}")
