"""What planning needs to know about a family's model class, declared as data.

Planning needs, of the transformers class a checkpoint loads into: its state-dict names and
shapes, every LayerNorm in it (``layer_norm_like``; a norm the adapter does not describe is refused), its
``base_model_prefix``, transformers' load-time renaming of checkpoint keys, and its module
paths (which resolve the adapter's structure patterns). Building the class on the meta device
tells all of that, but importing torch and transformers takes seconds; an adapter may instead
declare, per class it knows, a function of the config that states the same facts (``ModelFacts``),
written the way the class derives its modules from the config. ``facts_of_model`` reads the same
facts from a built model; a test holds the declarations equal to it for every variant.

Module paths are those of every module that holds a tensor, with their ancestors: the structure
patterns adapters use name such modules, and the test checks they resolve to the same paths.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# the renamings transformers applies to every class's checkpoint keys on load (legacy gamma/beta
# of LayerNorms, weight-norm parametrisations, nested language models), as (regex, replacement)
COMMON_RENAMES: tuple[tuple[str, str], ...] = (
    (r"LayerNorm\.gamma", "LayerNorm.weight"),
    (r"LayerNorm\.beta", "LayerNorm.bias"),
    (r"\.weight_g", ".parametrizations.weight.original0"),
    (r"\.weight_v", ".parametrizations.weight.original1"),
    (r"^model\.language_model\.model|^language_model\.model\.model", "model.language_model"),
)


@dataclass(frozen=True)
class ModelFacts:
    """The facts about one model class, for one config, that planning uses."""

    base_prefix: str
    tensors: dict[str, tuple[int, ...]]  # state-dict name -> shape, in the class's order
    layer_norms: tuple[str, ...]  # module paths of every LayerNorm, in the class's order
    renames: tuple[tuple[str, str], ...] = COMMON_RENAMES

    @property
    def model_keys(self) -> set[str]:
        return set(self.tensors)

    @property
    def module_names(self) -> list[str]:
        """Every module that holds a tensor, and its ancestors ("" is the model), in order."""
        names = {"": None}
        for name in self.tensors:
            parts = name.split(".")[:-1]
            for end in range(1, len(parts) + 1):
                names.setdefault(".".join(parts[:end]), None)
        return list(names)

    def rename(self, name: str) -> str:
        """transformers' load-time renaming of the checkpoint key ``name``."""
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name


@dataclass
class StateDict:
    """Builds ``ModelFacts`` in the class's registration order, one module at a time."""

    base_prefix: str
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    layer_norms: list[str] = field(default_factory=list)
    renames: tuple[tuple[str, str], ...] = COMMON_RENAMES

    def add(self, module: str, **shapes: tuple[int, ...]) -> StateDict:
        """Tensors of ``module`` ("" for the model itself): ``add("wte", weight=(vocab, d))``."""
        for name, shape in shapes.items():
            self.tensors[f"{module}.{name}" if module else name] = tuple(shape)
        return self

    def layer_norm(self, module: str, width: int, *, affine: bool = True, bias: bool = True) -> StateDict:
        """An nn.LayerNorm; without ``affine`` it holds no tensor (but is a LayerNorm all the same)."""
        self.layer_norms.append(module)
        if not affine:
            return self
        return self.add(module, weight=(width,), **({"bias": (width,)} if bias else {}))

    def linear(self, module: str, inputs: int, outputs: int, *, bias: bool = True) -> StateDict:
        """An nn.Linear: weight [out, in]."""
        return self.add(module, weight=(outputs, inputs), **({"bias": (outputs,)} if bias else {}))

    def conv1d(self, module: str, inputs: int, outputs: int) -> StateDict:
        """A GPT-2 Conv1D: weight [in, out], with a bias."""
        return self.add(module, weight=(inputs, outputs), bias=(outputs,))

    def facts(self) -> ModelFacts:
        return ModelFacts(self.base_prefix, dict(self.tensors), tuple(self.layer_norms), self.renames)


# config -> facts, per class name an adapter knows
FactsByClass = dict[str, Callable[[dict], ModelFacts]]


def sole_class(name: str, facts: Callable[[dict], ModelFacts]) -> dict[str, Any]:
    """An ``Architecture``'s ``classes`` and ``default_class`` for a family whose Auto class
    builds the one class ``name``, whose facts ``facts`` declares."""
    return {"classes": {name: facts}, "default_class": name}


def declared_facts(classes: FactsByClass, default_class: str | None, config: dict) -> ModelFacts | None:
    """The declared facts for the class ``config`` loads into, or None when not declared.

    The class is the first one named in ``architectures`` (without that list, ``default_class``,
    the one the family's Auto class builds). None (an unknown class, a class of another family,
    a config that names none and no default, a setting not stated plainly): the caller builds the
    class instead, which also gives transformers' own refusals.
    """
    names = config.get("architectures") or ([default_class] if default_class else [])
    name = names[0] if isinstance(names, list) and names else None
    build = classes.get(name) if isinstance(name, str) else None
    try:
        return build(config) if build is not None else None
    except Unstated:
        return None


def facts_of_model(model: nn.Module) -> ModelFacts:
    """The same facts, read from ``model`` built on the meta device (imports torch). Its
    renaming is left empty: ``normswap.modeling.build.checkpoint_renamer`` is transformers' own."""
    from normswap.modeling.remote import layer_norm_like

    return ModelFacts(
        base_prefix=model.base_model_prefix,
        tensors={name: tuple(value.shape) for name, value in model.state_dict().items()},
        layer_norms=tuple(name for name, module in model.named_modules() if layer_norm_like(module)),
        renames=(),
    )


class Unstated(Exception):
    """A setting the declared facts depend on is not stated plainly in config.json."""


_REQUIRED = object()


def stated(config: dict, key: str, default: object = _REQUIRED, *, size: bool = False, aliases: tuple[str, ...] = ()) -> object:
    """``config[key]``; ``default`` (the config class's constant default) when absent.

    Raises ``Unstated`` when the key is absent without a default, when a config-class alias of it
    (``attribute_map``: ``hidden_size`` for GPT-2's ``n_embd``) is present, or, with ``size``, when
    the value is not a positive integer: the class is then built, and judges the config itself.
    """
    if any(alias in config for alias in aliases):
        raise Unstated(key)
    value = config.get(key, default)
    if value is _REQUIRED or (size and not (isinstance(value, int) and not isinstance(value, bool) and value > 0)):
        raise Unstated(key)
    return value
