"""What a converted checkpoint says about itself: its config.json (the source's, rewritten, with the
``normswap`` provenance block) and its model card (README.md), for ``convert`` and ``rotate``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from normswap import __version__
from normswap.architectures import ARCHITECTURES
from normswap.checkpoint.bounded import parse_yaml
from normswap.checkpoint.files import inside_file
from normswap.dtypes import dtype_name
from normswap.errors import NormswapError
from normswap.modeling import modeling_sha256
from normswap.text import format_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from normswap.architectures import Architecture
    from normswap.convert.plan import ConversionPlan

MODEL_CARD = """\
{front_matter}# RMSNorm conversion of `{source}`

This checkpoint was written by normswap {version}. It computes
the same function as `{source}` with every LayerNorm replaced by an RMSNorm.
{lineage}
## What was done

- **Centred the residual writers** ({writers} tensors: embeddings, attention and MLP output
  projections and their biases) in float64, by applying C = I − 11ᵀ/d along the hidden
  dimension. Every write into the residual stream is then orthogonal to the all-ones vector, the
  stream has zero mean, and LayerNorm(x) = RMSNorm(x) exactly, eps included.
- **Untied:** {untied}. The head reads the stream; it does not write it, so it keeps the original
  matrix.
- **Swapped {norms} norms** for RMSNorm (same eps; γ and β kept as weight and bias).
- **Folded gains:** {fold_gains}.
- Method `{method}`, weights stored as `{dtype}`.

## Loading

```python
from transformers import {auto_class}
model = {auto_class}.from_pretrained(PATH)                           # stock classes
model = {auto_class}.from_pretrained(PATH, trust_remote_code=True)   # RMSNorm modules

import normswap
model = normswap.load(PATH)                                                   # RMSNorm + fused kernels
```

{stock}

## Verification

`{source}` and this checkpoint were run on the same probe ({probe} tokens), both computed in
float32. Tolerance on max |Δ|: {tolerance:.3g}.

{table}
"""

ROTATION_SECTION = """
## Rotation

The residual stream is rotated by an orthogonal matrix Q ({method}{seed}; {construction}; d = {dimension}; \
sha256 {matrix_sha256}), stored in `{matrix_file}`. Every writer, reader and kept norm bias was rotated, so \
the model computes its source's function while its hidden states are x·Q. Load it with \
`trust_remote_code=True` or `normswap.load`; stock LayerNorm classes refuse it on purpose, because \
LayerNorm(x·Q) ≠ LayerNorm(x)·Q.
"""

COMMUTING_CARD = """\
{front_matter}# `{source}`, its residual stream rotated

Written by normswap {version}. It computes the same function as
`{source}` with the stock classes: load it with `{auto_class}.from_pretrained(PATH)`, no remote code.
{lineage}
## What was done

- **Folded** the gain γ and bias β of {folded} LayerNorms into the layers that read them (where a
  reader has no bias slot, β ⊘ γ stays in the norm); the LayerNorm modules stay, with weight 1.
- **Untied:** {untied}. The head reads the stream; it does not write it.
- **Rotated** the residual stream (below). Weights stored as `{dtype}`.

## Verification

{table}
"""

COMMUTING_SECTION = """
## Rotation (commuting with LayerNorm)

The residual stream is rotated by an orthogonal matrix Q with Q·1 = 1 ({method}{seed}; {construction}; \
d = {dimension}; sha256 {matrix_sha256}), stored in `{matrix_file}`. Such a Q commutes with LayerNorm's \
mean removal, so LayerNorm(x·Q) = LayerNorm(x)·Q and the stock LayerNorm modules (weight 1; γ and β \
folded into the layers that read them) compute its source's function: stock transformers loads \
this checkpoint as it is. Hidden states are x·Q. Outputs that come out rotated: {outputs}. Streams \
left unrotated: {fixed}.
"""


def provenance_block(source: str, plan: ConversionPlan, options: dict, auto_class: str) -> dict:
    """The ``normswap`` block of config.json: what was done, with which options and version."""
    return {
        "version": __version__,
        "source": source,
        "options": options,
        "original_model_type": plan.model_type,
        "norms_swapped": [norm.name for norm in plan.norms],
        "norms_folded": [norm.name for norm in plan.norms if norm.folded_gain],
        "writers_centred": len(plan.writers),
        "untied": [head for head, _ in plan.untied],
        "stock_loadable": plan.stock_loadable,
        "structure": plan.structure.to_json(),
        "auto_class": auto_class,
        # verify refuses a checkpoint whose modeling file is not the one written here
        "modeling_sha256": modeling_sha256(),
    }


def rotation_provenance(source: str, plan: ConversionPlan, auto_class: str, dtype: torch.dtype,
                        rotation: dict, source_block: dict | None) -> dict:
    """The ``normswap`` block of a rotated checkpoint: a folded source's block carried over (or a
    fresh one for an original), with the rotation added.

    A rotation of a folded conversion was checked against that conversion only, so ``source`` and
    ``rotated_from`` name it, and ``rotated_from_source`` keeps what its own provenance names as
    its original (not compared with the rotation: verify the folded conversion against it)."""
    if source_block is not None:
        block = {key: value for key, value in source_block.items() if key != "verification"}
        block.update({"version": __version__, "source": source, "rotated_from": source})
        if isinstance(source_block.get("source"), str):
            block["rotated_from_source"] = source_block["source"]
        block["options"] = {**block.get("options", {}), "dtype": dtype_name(dtype)}
    else:
        options = {"method": "exact", "fold_gains": True, "dtype": dtype_name(dtype)}
        block = provenance_block(source, plan, options, auto_class)
    # the commuting form (Q·1 = 1) keeps the stock LayerNorm exact; the free form needs the RMSNorm class
    block["stock_loadable"] = rotation.get("form") == "commuting" and plan.stock_loadable
    block["rotation"] = rotation
    return block


def converted_config(config: dict, plan: ConversionPlan, meta: nn.Module | None, architecture: Architecture,
                     provenance: dict) -> dict:
    """config.json of the output: the source's, untied, with auto_map and the provenance block.

    The classes it names are those of ``meta`` (the model built on the meta device), or, when the
    plan came from the adapter's declarations and nothing was built (``meta`` None), the ones
    transformers' tables give for the config.

    A checkpoint the stock class cannot hold (``provenance["stock_loadable"]`` false: a naive
    swap, a baked norm, a rotation) gets the model type ``normswap_<type>``, which stock
    transformers refuses to load.
    """
    from normswap.modeling import build, remote

    new = dict(config)
    if plan.untied:
        new[architecture.tie_flag] = False
    dtypes = {tensor.dtype for tensor in plan.tensors.values() if tensor.dtype.is_floating_point}
    if len(dtypes) == 1:
        new["dtype"] = dtype_name(dtypes.pop())
        if "torch_dtype" in new:
            new["torch_dtype"] = new["dtype"]
    if meta is None:
        model_name, config_name = build.class_names(config, architecture.auto_class)
    else:
        model_name, config_name = type(meta).__name__, type(meta.config).__name__
    new["architectures"] = [model_name]
    new.pop("auto_map", None)
    entries = auto_map(config["model_type"], model_name, config_name, architecture.auto_class, provenance)
    if entries is not None:
        new["auto_map"] = entries
    if not provenance["stock_loadable"]:
        new["model_type"] = remote.MODEL_TYPE_PREFIX + config["model_type"]
    new["normswap"] = provenance
    return new


def lineage(provenance: dict) -> str:
    """The card's line on a rotation of a normswap conversion: what was compared, and what was not."""
    if "rotated_from" not in provenance:
        return ""
    original = provenance.get("rotated_from_source")
    named = f" names `{original}` as its original" if original else " names its original"
    return (f"\n`{provenance['rotated_from']}` is itself a normswap conversion, and this checkpoint was verified "
            f"against it alone. Its own provenance{named}; that claim was not checked here (verify it with "
            f"`normswap verify ORIGINAL {provenance['rotated_from']}`).\n")


def auto_map(model_type: str, model_name: str, config_name: str, auto_class: str, provenance: dict) -> dict | None:
    """The ``auto_map`` of a converted checkpoint whose model class is ``model_name`` (config class
    ``config_name``): every entry names a class of ``modeling_normswap.py``; None when it has none
    (an uncentred stream, which the RMSNorm class would not compute). ``AutoConfig`` is mapped only
    for the ``normswap_<type>`` model type a checkpoint the stock class cannot hold gets."""
    from normswap.modeling import build, remote

    # the family's Auto class, and every other Auto class that maps this type to this class
    # (AutoModelForImageClassification for a ViTForImageClassification)
    autos = [auto_class, *build.auto_classes_for(model_type, model_name)]
    if provenance["stock_loadable"] and not provenance.get("rotation", {}).get("centred", True):
        return None
    if provenance["stock_loadable"]:
        return {auto: f"modeling_normswap.{remote.CLASS_PREFIX}{model_name}" for auto in autos}
    return {
        "AutoConfig": f"modeling_normswap.{remote.CLASS_PREFIX}{config_name}",
        **{auto: f"modeling_normswap.{remote.OWN_TYPE_PREFIX}{model_name}" for auto in autos},
    }


def model_card(provenance: dict, fields: dict[str, str] | None = None) -> str:
    """README.md of a converted checkpoint: the hub's card ``fields`` (``hub_fields``) in its front
    matter, then what was done, how to load it, the measured figures."""

    verification = provenance.get("verification")
    options = provenance["options"]
    folded = len(provenance["norms_folded"])
    rotation = provenance.get("rotation")
    commuting = rotation is not None and not rotation.get("centred", True)
    front = front_matter(("normswap", "rotation" if commuting else "rmsnorm"), fields or {})
    card = MODEL_CARD.format(
        front_matter=front, source=provenance["source"], lineage=lineage(provenance),
        auto_class=provenance["auto_class"],
        version=provenance["version"],
        method=options["method"],
        fold_gains=(f"yes, {folded} norm{'s' if folded != 1 else ''} folded into the layers that read them"
                    if options["fold_gains"] else "no; the norms keep their γ and β"),
        dtype=options["dtype"],
        norms=len(provenance["norms_swapped"]),
        writers=provenance["writers_centred"],
        untied=", ".join(provenance["untied"]) or "nothing (the head was not tied)",
        stock=(
            "Stock transformers loads it and computes its source's outputs exactly."
            if provenance["stock_loadable"]
            else "Stock transformers refuses it on purpose (its model type is "
            "normswap-specific): the stock class would not compute this model."
        ),
        table=format_table(verification["loaders"]) if verification else "(not verified)",
        probe=(verification or {}).get("probe", "-"),
        tolerance=(verification or {}).get("tolerance", {}).get("limit", float("nan")),
    )
    if commuting:
        card = COMMUTING_CARD.format(front_matter=front, source=provenance["source"], version=provenance["version"], lineage=lineage(provenance),
                                     auto_class=provenance["auto_class"], folded=folded, dtype=options["dtype"],
                                     untied=", ".join(provenance["untied"]) or "nothing (the head was not tied)",
                                     table=format_table(verification["loaders"]) if verification else "(not verified)")
    if rotation is not None:
        seed = "" if rotation["seed"] is None else f", seed {rotation['seed']}"
        section = COMMUTING_SECTION if rotation.get("form") == "commuting" else ROTATION_SECTION
        card += section.format(**{**rotation, "seed": seed, "fixed": ", ".join(rotation.get("fixed_streams", {}).values())
                                  or "none", "outputs": ", ".join(rotation.get("rotated_outputs", {})) or "none"})
    return card


# ---------------------------------------------------------------------------------------------
# The hub's card fields

# the hub's task of each model class, by the end of its name (normswap_<type> classes end alike)
_TASKS = (("ForImageClassification", "image-classification"), ("ForImageClassificationWithTeacher", "image-classification"),
          ("ForCausalLM", "text-generation"), ("LMHeadModel", "text-generation"),
          ("ForConditionalGeneration", "text2text-generation"))
_LICENSE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}")  # a hub license id: apache-2.0, cc-by-nc-4.0, other
IN_MEMORY = "an in-memory model"  # the source of a model built in memory, which names no base model
_CARD_BYTES = 64 << 10  # a card's front matter lies at its start; the rest is prose


def front_matter(tags: tuple[str, ...], fields: dict[str, str]) -> str:
    """The card's YAML front matter: library, tags, then ``fields`` in a stable order (values as
    JSON strings, which YAML reads as they are, whatever characters a path holds)."""
    lines = ["---", "library_name: transformers", "tags:", *(f"- {tag}" for tag in tags)]
    lines += [f"{key}: {json.dumps(fields[key])}" for key in ("base_model", "license", "pipeline_tag") if fields.get(key)]
    return "\n".join([*lines, "---", ""])


def pipeline_tag(model_type: str, class_name: str) -> str:
    """The hub's ``pipeline_tag`` of a model of ``model_type`` loaded as ``class_name``."""

    if model_type == "whisper":
        return "automatic-speech-recognition"
    task = next((task for suffix, task in _TASKS if class_name.endswith(suffix)), None)
    if task is not None:
        return task
    if class_name.endswith("CLIPModel"):
        return "zero-shot-image-classification"
    family = next((a for a in ARCHITECTURES.values() if model_type in a.model_types), None)
    if class_name.endswith("CLIPVisionModel") or (family is not None and family.probe == "vision"):
        return "image-feature-extraction"
    return "feature-extraction"


def hub_fields(provenance: dict, config: dict, source_dir: Path | None) -> dict[str, str]:
    """The card fields the hub and its users read: ``base_model`` (the source as it was named),
    ``pipeline_tag`` (from the written class) and ``license``, copied from the source's own card."""
    classes = config.get("architectures") or [""]
    source = provenance.get("source") or ""
    fields = {"base_model": "" if source == IN_MEMORY else source,
              "pipeline_tag": pipeline_tag(provenance.get("original_model_type", ""), str(classes[0]))}
    license = source_license(source_dir) if source_dir is not None else None
    if license is not None:
        fields["license"] = license
    return fields


def source_license(folder: Path) -> str | None:
    """The ``license`` of the card (README.md) in ``folder``, from its YAML front matter; None when
    it has no card, no front matter, or none this reads (a card is prose for people: a front
    matter that does not parse gives no license rather than refusing the checkpoint)."""

    try:
        path = inside_file(folder, "README.md")
        if path is None:
            return None
        with open(path, "rb") as handle:
            head = handle.read(_CARD_BYTES).decode("utf-8", errors="replace").replace("\r\n", "\n")
        if not head.startswith("---\n") or "\n---" not in head[3:]:
            return None
        matter = parse_yaml(head[4:head.index("\n---", 3)], f"{path}'s front matter")
    except (NormswapError, OSError):
        return None
    license = matter.get("license") if isinstance(matter, dict) else None
    return license if isinstance(license, str) and _LICENSE.fullmatch(license) else None
