"""Plan: from an adapter and a checkpoint's tensor list, what happens to every output tensor.

The plan is data, computed before any weight is read: for each output tensor, the source tensor
it starts from and the ordered steps applied to it (bake, centre, fold a gain, fold a bias, ...).
``normswap inspect`` prints it; ``normswap.convert.write`` streams it out one tensor at a time,
through ``normswap.convert.fold``, which executes the steps.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from normswap.architectures.facts import ModelFacts
from normswap.architectures.spec import Architecture, HeadNorm, Norm
from normswap.checkpoint.names import canonical_names, output_shard_names
from normswap.checkpoint.source import TensorInfo
from normswap.convert.heads import centre_heads, fold_layer_scales
from normswap.convert.names import resolve_structure
from normswap.convert.steps import (
    Bake,
    Centre,
    DivideByGain,
    Fill,
    FoldBias,
    FoldGain,
    NormPlan,
    Structure,
    TensorPlan,
)
from normswap.dtypes import is_floating
from normswap.errors import NormswapError

if TYPE_CHECKING:  # planning imports no torch; tensors are read and written elsewhere
    import torch


@dataclass
class ConversionPlan:
    """The whole conversion of one checkpoint, before any weight is read."""

    model_type: str
    method: str
    fold_gains: bool
    tensors: dict[str, TensorPlan]
    norms: list[NormPlan]
    writers: list[str]
    untied: list[tuple[str, str]]
    dropped: list[str]
    renamed: dict[str, str]
    structure: Structure
    shards: list[str]

    @property
    def stock_loadable(self) -> bool:
        """Whether the stock LayerNorm class computes the converted model exactly.

        It does when every write is centred (LayerNorm's mean removal is then a no-op) and no
        module was removed. A naive swap changes the function, and a baked embedding norm must not
        be applied a second time, so those get their own model type, which stock transformers
        refuses to load.
        """
        return self.method == "exact" and not self.structure.identity

    def summary(self) -> dict:
        return {
            "model_type": self.model_type,
            "method": self.method,
            "fold_gains": self.fold_gains,
            "norms": len(self.norms),
            "writers_centred": len(self.writers),
            "norms_folded": sum(norm.folded_gain for norm in self.norms),
            "untied": [f"{head} <- {embedding}" for head, embedding in self.untied],
            "dropped": self.dropped,
            "structure": self.structure.to_json(),
            "shards": len(self.shards),
        }


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassNames:
    """What the family's model class says a checkpoint holds, from the class built on the meta
    device or from the facts its adapter declares: ``model_keys`` (the canonical state-dict
    names), ``layer_norm_modules`` (every ``nn.LayerNorm``), ``base_prefix``, ``rename``
    (transformers' load-time key renaming, see ``canonical_names``; None: none) and
    ``module_names`` (every module path, which resolves the adapter's structure patterns)."""

    model_keys: set[str]
    layer_norm_modules: list[str]
    base_prefix: str
    rename: Callable[[str], str] | None = None
    module_names: list[str] | None = None

    @classmethod
    def of_facts(cls, facts: ModelFacts, rename: Callable[[str], str] | None = None,
                 module_names: list[str] | None = None) -> ClassNames:
        """The names ``facts`` gives; ``rename`` and ``module_names`` replace the declared ones
        (by transformers' own, for a built class)."""
        return cls(facts.model_keys, list(facts.layer_norms), facts.base_prefix, rename or facts.rename,
                   facts.module_names if module_names is None else module_names)


def build_plan(architecture: Architecture, config: dict, tensors: dict[str, TensorInfo], names: ClassNames, *,
               method: str = "exact", fold_gains: bool = False, dtype: torch.dtype | str | None = None,
               read_small: Callable[[str], torch.Tensor] | None = None) -> ConversionPlan:
    """The plan for converting a checkpoint with ``tensors`` (source names -> info).

    Every ``nn.LayerNorm`` of the model class (``names``) must be covered by the adapter, or the
    conversion would not be exact. ``read_small(name)`` reads a small tensor (a norm gain) now, to
    check it for zeros. The output is written under transformers' renamed names, which must be
    fixed points of the renaming.
    """
    model_keys, layer_norm_modules, rename = names.model_keys, names.layer_norm_modules, names.rename
    if method not in ("exact", "naive"):
        raise NormswapError(f"unknown method '{method}'; use exact or naive")
    renamed = canonical_names(list(tensors), model_keys, names.base_prefix, rename)
    if rename is not None:
        for name in renamed.values():
            if name in model_keys and rename(name) != name:
                raise NormswapError(f"transformers would rename the output tensor {name} on load; not supported")
    plans, dropped, shards = _tensor_plans(architecture, tensors, renamed, dtype)
    untied = _untie(architecture, config, plans, model_keys)
    for copy, table in architecture.shared:  # an untied checkpoint ties nothing: write every copy
        if copy in model_keys and copy not in plans and table in plans:
            plans[copy] = replace(plans[table], name=copy, steps=[])
    _refuse_missing(model_keys, plans)
    structure = resolve_structure(architecture.structure(config), names.module_names)
    norms = _find_norms(architecture, plans, layer_norm_modules)
    norms += _bake(architecture, config, plans, dropped, structure)  # before centring the table
    writers = []
    # λ into its writer (an identity), before centring or rotating it
    fold_layer_scales(architecture, plans)
    if method == "exact":
        writers = _centre_writers(architecture, plans)
    if fold_gains:
        for norm in norms:
            if norm.baked_into is None and not norm.per_head:
                _fold_norm(norm, architecture, plans, set(writers), read_small)
    if method == "exact":
        centre_heads(architecture, plans, norms)  # after a bias fold, which adds Wβ to the rows
    structure.gain_plus_one += [norm.name for norm in norms if norm.baked_into is None and not norm.per_head
                                and _norm_spec(architecture, norm.name).gain_offset == 1]
    return ConversionPlan(
        model_type=config.get("model_type", "?"), method=method, fold_gains=fold_gains,
        tensors=dict(sorted(plans.items())), norms=norms, writers=writers, untied=untied, dropped=sorted(dropped),
        renamed={old: new for old, new in renamed.items() if old != new}, structure=structure, shards=shards,
    )


def _tensor_plans(architecture: Architecture, tensors: dict[str, TensorInfo], renamed: dict[str, str],
                  dtype: torch.dtype | str | None) -> tuple[dict[str, TensorPlan], list[str], list[str]]:
    """A step-less plan per kept tensor (under its canonical name), the dropped names, the output shards."""
    shard_names = output_shard_names(sorted({info.shard for info in tensors.values()}))
    plans: dict[str, TensorPlan] = {}
    dropped = []
    for source_name, info in tensors.items():
        name = renamed[source_name]
        if any(re.fullmatch(pattern, name) for pattern in architecture.ignore):
            dropped.append(name)
            continue
        out_dtype = dtype if dtype is not None and is_floating(info.dtype_name) else info.dtype_name
        plans[name] = TensorPlan(name, info.name, info.shape, out_dtype, shard_names[info.shard])
    return plans, dropped, sorted(set(shard_names.values()))


def _bake(architecture: Architecture, config: dict, plans: dict[str, TensorPlan], dropped: list[str],
          structure: Structure) -> list[NormPlan]:
    """Bake embedding norms into their tables; the norm module becomes an identity."""
    baked = []
    for bake in architecture.bake:
        if bake.embedding not in plans:
            continue
        eps = float(config.get("layer_norm_epsilon", config.get("layer_norm_eps", 1e-5)))
        plans[bake.embedding].steps.append(
            Bake(plans[f"{bake.norm}.weight"].source, plans[f"{bake.norm}.bias"].source, eps, axis=1)
        )
        for suffix in (".weight", ".bias"):
            dropped.append(bake.norm + suffix)
            del plans[bake.norm + suffix]
        structure.identity.append(bake.norm)
        baked.append(NormPlan(bake.norm, [], baked_into=bake.embedding, note="baked into the table; nothing left to fold"))
    return baked


def _centre_writers(architecture: Architecture, plans: dict[str, TensorPlan]) -> list[str]:
    """Centre every tensor that writes the stream along its hidden axis; their names."""
    writers = []
    for name, plan in plans.items():
        for writer in architecture.writers:
            if re.fullmatch(writer.pattern, name):
                plan.steps.append(Centre(writer.hidden_axis))
                writers.append(name)
                break
    return writers


def _refuse_missing(model_keys: set[str], plans: dict[str, TensorPlan]) -> None:
    """Refuse a checkpoint lacking a weight the model built from its config has: transformers would
    start that weight from random values, and nothing after would mean anything."""
    missing = sorted(model_keys - set(plans))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise NormswapError(f"the weights hold no tensor {missing[0]}{more}, which the model that config.json "
                            "describes needs; it would start from random values")


def _untie(architecture: Architecture, config: dict, plans: dict[str, TensorPlan], model_keys: set[str]):
    """Give a tied head its own copy of the original embedding: the head reads, it does not write."""
    untied = []
    tied_flag = config.get(architecture.tie_flag)
    if tied_flag is None:
        tied_flag = architecture.tie_default
    if tied_flag is None:
        tied_flag = _config_default(config, architecture.tie_flag, True)
    tied_flag = bool(tied_flag)
    for head, embedding in architecture.tied:
        if embedding not in plans or head not in model_keys:
            continue
        if head in plans and not tied_flag:
            continue  # already a separate matrix
        if not tied_flag:
            raise NormswapError(
                f"config.json sets {architecture.tie_flag}=false but the checkpoint has no {head}: "
                "transformers would initialise that head at random, so the original computes no fixed function")
        source = plans[embedding]
        plans[head] = TensorPlan(head, source.source, source.shape, source.dtype_name, source.shard)
        untied.append((head, embedding))
    return untied


def _config_default(config: dict, key: str, fallback):
    """The value transformers' config class gives ``key`` when config.json omits it.

    Families differ: GPT-2 ties its head by default, GPT-J, GPT-NeoX, Phi and CodeGen do not, so a
    config.json without ``tie_word_embeddings`` means different things per family.
    """
    from transformers import CONFIG_MAPPING

    try:
        return getattr(CONFIG_MAPPING[config.get("model_type")](), key, fallback)
    except Exception:  # unknown type, or a config class that needs arguments
        return fallback


def _find_norms(architecture: Architecture, plans: dict[str, TensorPlan], layer_norm_modules: list[str]):
    baked = {bake.norm for bake in architecture.bake}
    norms = []
    for module in layer_norm_modules:
        if module in baked:
            continue
        spec = next((norm for norm in architecture.norms if re.fullmatch(norm.pattern, module)), None)
        if spec is None and any(re.fullmatch(head.pattern, module) for head in architecture.head_norms):
            norms.append(NormPlan(module, [], per_head=True, note="per-head norm; its projection is centred per "
                                  "head, gains kept"))
            continue
        if spec is None:
            raise NormswapError(
                f"the {architecture.model_types[0]} adapter does not describe the norm '{module}'; "
                "converting would not be exact"
            )
        groups = re.fullmatch(spec.pattern, module).groupdict()
        readers = [reader.weight.format(**groups) for reader in spec.readers]
        norms.append(NormPlan(module, readers))
    return norms


def _norm_spec(architecture: Architecture, name: str) -> Norm | HeadNorm:
    return next(s for s in (*architecture.norms, *architecture.head_norms) if re.fullmatch(s.pattern, name))


def _fold_norm(norm: NormPlan, architecture: Architecture, plans: dict[str, TensorPlan], writers: set[str], read_small) -> None:
    """Fold a norm's γ (and β where every reader has a bias slot) into the layers that read it.

    A norm with ``gain_offset`` stores γ - offset: γ is read as stored + offset, and the stored
    weight left behind is 1 - offset (a unit gain)."""
    spec = _norm_spec(architecture, norm.name)
    if spec.output_is_model_output:
        norm.note = "output is a model output; gains kept"
        return
    gain_name, bias_name = f"{norm.name}.weight", f"{norm.name}.bias"
    if gain_name not in plans:
        norm.note = "no gain"
        return
    groups = re.fullmatch(spec.pattern, norm.name).groupdict()
    readers = []
    for reader in spec.readers:
        weight = reader.weight.format(**groups)
        bias = reader.bias.format(**groups) if reader.bias else None
        if weight not in plans:
            raise NormswapError(f"norm {norm.name} should be read by {weight}, which the checkpoint lacks")
        if weight in writers or (bias and bias in writers):
            raise NormswapError(f"{weight} both reads a norm and writes the stream; not supported")
        readers.append((reader, weight, bias if bias in plans else None))
    if not readers:
        norm.note = "no readers to fold into"
        return
    has_bias = bias_name in plans
    # β folds when every reader can take Wβ: into its bias, or dropped where a constant cancels
    bias_foldable = has_bias and all(bias is not None or reader.constant_cancels for reader, _, bias in readers)
    offset = spec.gain_offset
    if has_bias and not bias_foldable and read_small is not None:
        if bool((read_small(plans[gain_name].source) + offset == 0).any()):
            norm.note = "γ has zeros and β cannot be folded; kept unfolded"
            return

    gain_source = plans[gain_name].source
    for reader, weight, bias in readers:
        if bias_foldable and bias is not None:
            plans[bias].steps.append(FoldBias(plans[weight].source, plans[bias_name].source, reader.input_axis))
        plans[weight].steps.append(FoldGain(gain_source, reader.input_axis, offset))
    plans[gain_name].steps.append(Fill(1.0 - offset))
    norm.folded_gain = True
    if has_bias:
        if bias_foldable:
            plans[bias_name].steps.append(Fill(0.0))
            norm.folded_bias = True
        else:
            plans[bias_name].steps.append(DivideByGain(gain_source, offset))
            norm.kept_bias = "β/γ"
