"""Recipes: one YAML file that names a model, how to convert it, and how to judge the result.

    name: austen-gpt2                 # optional; defaults to the file name
    description: ...                  # optional
    source: normswap:austen-gpt2      # hub id, local checkpoint dir, or the bundled example
    convert:                          # keyword arguments of normswap.convert_checkpoint
      fold_gains: false
      method: exact
      dtype: null
      trust_remote_code: false        # may turn --trust-remote-code off; only the flag turns it on
    verify:                           # the conversion's built-in logit check
      atol: null                      # max |Δlogit|; null: the default for the dtype
      rtol: null
      allow_inexact: false
      verification: auto              # auto, layerwise, full
    eval:                             # identical for original and converted (see EvalSettings)
      dtype: float32
      batch_size: 8
      max_length: null
      stride: null
      text: bundled                   # file, dir, bundled, or wikitext-2-raw-v1
      perplexity: true
      tasks: [local]
      limit: null
      audio: null                     # speech models: audio folder, JSONL manifest, or bundled
      images: null                    # vision models: image folder (class subfolders), or bundled
    tolerances:                       # verdict limits; omitted ones take the dtype's defaults
      ppl_rtol: 1.0e-4
      acc_atol: 0.005
      doc_ll_atol: 1.0e-2
    reference:                        # published figures for the original, shown beside ours
      source: "where they come from"
      figures:
        strided/token_perplexity: 29.94

``run_recipe`` executes convert → verify → eval → report into one output folder.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import normswap
from normswap.checkpoint import output
from normswap.checkpoint.bounded import read_yaml
from normswap.checkpoint.removal import remove_tree
from normswap.checkpoint.source import EXAMPLE_MODEL, source_inputs
from normswap.dtypes import canonical_name
from normswap.errors import NormswapError, quoted
from normswap.evaluation.hub import hub_reachable
from normswap.evaluation.text import DATASETS

SECTIONS = {"name", "description", "source", "convert", "verify", "eval", "tolerances", "reference"}
CONVERT_KEYS = {"fold_gains": bool, "method": str, "dtype": str, "trust_remote_code": bool}
VERIFY_KEYS = {"atol": float, "rtol": float, "allow_inexact": bool, "verification": str}
EVAL_KEYS = {"dtype": str, "batch_size": int, "max_length": int, "stride": int, "text": str,
             "perplexity": bool, "tasks": list, "limit": float, "device": str, "device_map": str,
             "audio": str, "images": str}
TOLERANCE_KEYS = {"ppl_rtol": float, "acc_atol": float, "doc_ll_atol": float}
# Recipe keys that switch a permission on, and the command-line flag that alone may grant it: a
# recipe is a file people download and share, so it may narrow a permission, never widen it.
PERMISSION_KEYS = {("convert", "trust_remote_code"): "--trust-remote-code"}
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # package data, in a wheel too
# a recipe's name becomes a folder name under runs/: never a path
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class Recipe:
    """A validated recipe."""

    name: str
    source: str
    path: Path
    description: str = ""
    convert: dict[str, Any] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    reference: dict[str, float] = field(default_factory=dict)
    reference_source: str | None = None


def _coerce(value: Any, kind: type, where: str) -> Any:
    """Check one value's type. YAML 1.1 reads ``1e-4`` as a string, so numbers in strings are accepted."""
    if value is None:
        return None
    if kind is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    elif isinstance(value, kind):
        return value
    raise NormswapError(f"{where} must be {'a list of names' if kind is list else kind.__name__} (got {value!r})")


def _mapping(value: Any, where: str, origin: str) -> dict[str, Any]:
    """``value`` (None read as empty) as a mapping whose keys are all strings, else a refusal."""
    value = value or {}
    if not isinstance(value, dict):
        raise NormswapError(f"{origin}: '{where}' must be a mapping")
    for key in value:
        if not isinstance(key, str):
            raise NormswapError(f"{origin}: '{where}' has the key {quoted(key)}, not a name")
    return value


def _section(data: dict[str, Any], name: str, keys: dict[str, type], origin: str) -> dict[str, Any]:
    section = _mapping(data.get(name), name, origin)
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise NormswapError(f"{origin}: unknown key(s) in '{name}': {', '.join(unknown)} "
                            f"(allowed: {', '.join(keys)})")
    return {key: _coerce(value, keys[key], f"{origin}: {name}.{key}") for key, value in section.items()}


def find_recipe(spec: str | Path) -> Path:
    """A recipe file: the path as given, else the bundled ``normswap/recipes/<spec>.yaml``."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    candidate = RECIPES_DIR / f"{spec}.yaml"
    if not path.suffix and candidate.is_file():
        return candidate
    raise NormswapError(f"recipe {spec} not found (pass a YAML file, or a name from {RECIPES_DIR})")


def load_recipe(spec: str | Path) -> Recipe:
    """Read and validate a recipe; every problem is a one-line ``NormswapError``."""
    path = find_recipe(spec)
    origin = f"recipe {path}"
    data = read_yaml(path, what=origin, mapping=False)
    if not isinstance(data, dict):
        raise NormswapError(f"{origin} must be a YAML mapping with at least 'source'")
    _mapping(data, "the top level", origin)
    unknown = sorted(set(data) - SECTIONS)
    if unknown:
        raise NormswapError(f"{origin}: unknown section(s) {', '.join(unknown)} (allowed: {', '.join(sorted(SECTIONS))})")
    source = data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise NormswapError(f"{origin}: 'source' (the model to convert) is required")
    reference = _mapping(data.get("reference"), "reference", origin)
    if set(reference) - {"source", "figures"}:
        raise NormswapError(f"{origin}: 'reference' must be a mapping with 'source' and 'figures'")
    if not isinstance(reference.get("source"), str | None):
        raise NormswapError(f"{origin}: reference.source must be a text naming where the figures come from")
    figures = _mapping(reference.get("figures"), "reference.figures", origin)
    if not isinstance(data.get("description"), str | None):
        raise NormswapError(f"{origin}: 'description' must be a text")
    name = data.get("name") or path.stem
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or name in (".", ".."):
        raise NormswapError(f"{origin}: 'name' must be a plain name (letters, digits, '.', '_', '-'), "
                            f"not a path (got {name!r:.60})")
    recipe = Recipe(
        name=name,
        description=str(data.get("description") or ""),
        source=source.strip(),
        path=path,
        convert=_section(data, "convert", CONVERT_KEYS, origin),
        verify=_section(data, "verify", VERIFY_KEYS, origin),
        eval=_section(data, "eval", EVAL_KEYS, origin),
        tolerances=_section(data, "tolerances", TOLERANCE_KEYS, origin),
        reference={k: _coerce(v, float, f"{origin}: reference.figures.{k}") for k, v in figures.items()},
        reference_source=reference.get("source"),
    )
    for key in recipe.reference:
        if "/" not in key:
            raise NormswapError(f"{origin}: reference figure '{key}' must be named task/metric")
    _check_values(recipe, origin)
    return recipe


def _check_values(recipe: Recipe, origin: str) -> None:
    """Refuse, when the recipe is read, every value a later step of ``run`` would refuse."""

    limits = {**{f"tolerances.{k}": v for k, v in recipe.tolerances.items()},
              **{f"verify.{k}": recipe.verify.get(k) for k in ("atol", "rtol")}}
    for where, value in limits.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise NormswapError(f"{origin}: {where} must be a finite number >= 0 (got {value!r})")
    from normswap.evaluation.lmeval import task_limit

    task_limit(recipe.eval.get("limit"), f"{origin}: eval.limit")
    for where, value in (("eval.batch_size", recipe.eval.get("batch_size")),
                         ("eval.max_length", recipe.eval.get("max_length")), ("eval.stride", recipe.eval.get("stride"))):
        if value is not None and value < 1:
            raise NormswapError(f"{origin}: {where} must be at least 1 (got {value})")
    for where, value in (("convert.dtype", recipe.convert.get("dtype")), ("eval.dtype", recipe.eval.get("dtype"))):
        if value is not None:
            try:
                canonical_name(value)
            except NormswapError as error:
                raise NormswapError(f"{origin}: {where}: {error}") from None
    if recipe.convert.get("method", "exact") not in ("exact", "naive"):
        raise NormswapError(f"{origin}: convert.method must be exact or naive (got {recipe.convert['method']!r:.40})")
    if recipe.verify.get("verification") == "none":
        raise NormswapError(f"{origin}: a recipe always verifies; remove verification: none")
    if recipe.verify.get("verification", "auto") not in ("auto", "layerwise", "full"):
        raise NormswapError(f"{origin}: verify.verification must be auto, layerwise or full "
                            f"(got {recipe.verify['verification']!r:.40})")
    for key in ("text", "audio", "images"):
        value = recipe.eval.get(key)
        if value and value.startswith(("/", "./", "../", "~")) and not Path(value).expanduser().exists():
            raise NormswapError(f"{origin}: eval.{key} {value} does not exist")


def permitted(recipe: Recipe, granted: dict[str, bool]) -> dict[str, bool]:
    """The permissions the run gets: each one the user ``granted`` on the command line (by flag),
    narrowed by the recipe. A recipe key that would grant what the user did not is refused."""
    allowed = {}
    for (section, key), flag in PERMISSION_KEYS.items():
        asked = getattr(recipe, section).get(key)
        given = bool(granted.get(flag, False))
        if asked and not given:
            raise NormswapError(f"recipe {recipe.path}: {section}.{key}: true cannot grant what only the command "
                                f"line can; pass {flag} yourself to allow it (or remove the key)")
        allowed[key] = given and asked is not False
    return allowed


def hub_needs(recipe: Recipe, settings) -> list[str]:
    """What in this recipe needs the Hugging Face hub (empty when it runs offline)."""
    from normswap.evaluation.lmeval import LOCAL_ALIAS, TEXT_TASK, local_tasks

    needs = []
    looks_local = recipe.source.startswith(("/", ".", "~")) or Path(recipe.source).expanduser().exists()
    if recipe.source != EXAMPLE_MODEL and not looks_local:
        needs.append(f"model {recipe.source}")
    local = set(local_tasks()) | {LOCAL_ALIAS, TEXT_TASK}
    hub_tasks = [t for t in settings.tasks if t not in local]
    if hub_tasks:
        needs.append(f"task(s) {', '.join(hub_tasks)}")
    if settings.perplexity and settings.text in DATASETS:
        needs.append(f"dataset {settings.text}")
    return needs


def convert_kwargs(recipe: Recipe, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``normswap.convert_checkpoint``: the recipe's, with verification on,
    and ``trust_remote_code`` as the caller decided it (``permitted``), never as the recipe says."""

    from normswap.api import convert_checkpoint

    accepted = set(inspect.signature(convert_checkpoint).parameters)
    kwargs = {**recipe.convert, **recipe.verify, "overwrite": False, "trust_remote_code": trust_remote_code}
    if kwargs.get("verification") == "none":
        raise NormswapError(f"recipe {recipe.path}: a recipe always verifies; remove verification: none")
    unsupported = sorted(set(kwargs) - set(accepted))
    if unsupported:
        raise NormswapError(f"recipe {recipe.path}: this normswap cannot convert with {', '.join(unsupported)}")
    return kwargs


def run_recipe(recipe: Recipe, out: Path, *, settings, tolerances, overwrite: bool = False,
               plot: bool = True, log=print) -> dict[str, Any]:
    """convert → verify → eval → report, everything in ``out``; returns the report.

    ``settings`` (EvalSettings) and ``tolerances`` are the recipe's, already merged with any
    command-line overrides. A failed verification raises ``VerificationError`` before evaluation.
    Everything is written into a temporary folder installed at ``out`` only when the whole run
    succeeded (see ``normswap.checkpoint.output``): a failed or interrupted run leaves nothing.
    """
    from normswap.evaluation.api import evaluate
    from normswap.evaluation.report import write_report

    permitted(recipe, {"--trust-remote-code": settings.trust_remote_code})
    needs = hub_needs(recipe, settings)
    if needs and not hub_reachable():
        raise NormswapError(
            f"recipe {recipe.name} needs the Hugging Face hub ({'; '.join(needs)}), which is unreachable; "
            "run it online, or try the offline recipe austen-gpt2"
        )
    out = output.absolute(out)

    inputs = [recipe.path]
    for item in (recipe.source, settings.text, settings.audio, settings.images):
        path = Path(item).expanduser() if item else None
        if path is not None and path.exists():
            inputs += source_inputs(path) if path.is_dir() else [path]
    with output.claimed_output(out, inputs=inputs, overwrite=overwrite, kind="run") as claim:
        folder = claim.tmp
        shutil.copyfile(recipe.path, folder / "recipe.yaml")
        converted = folder / "converted"
        log(f"[1/3] convert + verify {recipe.source} -> {out / 'converted'}")
        provenance = normswap.convert_checkpoint(recipe.source, converted, **convert_kwargs(recipe, trust_remote_code=settings.trust_remote_code))
        (folder / "conversion.json").write_text(json.dumps(provenance, indent=2, default=str) + "\n", encoding="utf-8")
        log(f"[2/3] evaluate original and converted ({', '.join(settings.tasks) or 'perplexity only'})")
        report = evaluate(
            str(converted), baseline=recipe.source, settings=settings, tolerances=tolerances,
            reference=recipe.reference or None, reference_source=recipe.reference_source, workdir=folder / "work",
        )
        for model in report.get("models", {}).values():
            if model.get("source") == str(converted):
                model["source"] = str(out / "converted")  # where it is once installed
        report["recipe"] = {"name": recipe.name, "path": str(recipe.path), "description": recipe.description}
        report["conversion"] = provenance
        log(f"[3/3] report -> {out}")
        write_report(report, folder, plot=plot)
        for path in remove_tree(folder / "work"):
            log(f"left {path} in place: it cannot be removed safely (another filesystem, a mount point, or denied)")
        claim.install()
    return report
