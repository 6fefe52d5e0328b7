"""The evaluation report: one JSON document, a Markdown rendering of it, and an optional chart (``plot``)."""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any

from normswap import __version__
from normswap.evaluation.compare import Comparison, reference_rows
from normswap.evaluation.runner import EvalSettings, ModelEval
from normswap.text import json_text


def build_report(
    models: list[ModelEval],
    settings: EvalSettings,
    *,
    comparison: Comparison | None = None,
    reference: dict[str, float] | None = None,
    reference_source: str | None = None,
    text: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything measured, as a JSON-ready dict (per-document values are reduced to the maxima)."""
    report: dict[str, Any] = {
        "normswap_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": settings.as_dict(),
        "text": text,
        "models": {
            m.label: {"source": m.source, "metrics": dict(m.metrics), "details": m.details} for m in models
        },
        "comparison": comparison.as_dict() if comparison else None,
        "verdict": None if comparison is None else ("pass" if comparison.passed else "fail"),
        "reference": None,
    }
    if reference:
        report["reference"] = {"source": reference_source, "rows": reference_rows(reference, models)}
    if extra:
        report.update(extra)
    return report


def _fmt(value: Any, digits: int = 6) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.3e}"
        return f"{value:.{digits}g}"
    return str(value)


def _ok(ok: bool) -> str:
    return "yes" if ok else "**FAIL**"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(cell) for cell in row) + " |" for row in rows]
    return lines


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for key, sub in value.items() for item in _flatten(f"{prefix}.{key}" if prefix else str(key), sub)]
    return [(prefix, value)]


def _conversion_lines(conversion: dict[str, Any]) -> list[str]:
    """The conversion's options and its built-in verification figures, as a two-column table."""
    lines = ["## Conversion and verification", ""]
    shown = {k: v for k, v in conversion.items() if k in ("source", "options", "verification")}
    # The figures that carry the claim; the rest stays in report.json and conversion.json.
    noise = ("max_abs_reference", "probe_shape", "compute_dtype", "perplexity_", "tolerance.rtol")
    rows = [[k, v] for k, v in _flatten("", shown or conversion) if not any(n in k for n in noise)]
    lines += _table(["field", "value"], rows)
    return lines + [""]


def _comparison_lines(report: dict[str, Any], comparison: dict[str, Any]) -> list[str]:
    """The side-by-side metrics, the per-document figures and any direct output agreement."""
    verdict = "PASS" if comparison["passed"] else "FAIL"
    lines = [f"## Comparison: {verdict}", ""]
    if report.get("unscored"):
        lines += [f"Nothing to score: {report['unscored']}. The two models' outputs are compared directly "
                  "instead: the pooled output and every token's hidden state, over all images and per image.", ""]
    if comparison["metrics"]:
        lines += _table(
            ["task/metric", "original", "converted", "Δ", "rel Δ", "tolerance", "ok"],
            [[r["key"], r["original"], r["converted"], r["delta"], r["rel_delta"], r["limit"], _ok(r["ok"])]
             for r in comparison["metrics"]],
        )
        lines.append("")
    if comparison["documents"]:
        unit = {"audio": "per utterance", "images": "per image, every class or text"}.get(
            report.get("modality"), "strided: per window")
        lines += [f"Per-document loglikelihood (nats; {unit}):", ""]
        lines += _table(
            ["task", "documents", "max abs Δ loglik", "worst doc", "tolerance", "ok"],
            [[d["task"], d["n_docs"], d["max_abs_delta_ll"], d["worst_doc"], d["limit"], _ok(d["ok"])]
             for d in comparison["documents"]],
        )
        lines.append("")
    lines += [f"- problem: {problem}" for problem in comparison["problems"]]
    if comparison["problems"]:
        lines.append("")
    if report.get("agreement"):
        lines += ["Outputs compared directly:", ""]
        lines += _table(["task/measure", "value", "limit", "ok"],
                        [[r["key"], r["value"], r["limit"], _ok(r["ok"])] for r in report["agreement"]])
        lines.append("")
    return lines


def _reference_lines(reference: dict[str, Any] | None, labels: list[str]) -> list[str]:
    """Published reference figures beside each model's, with the differences."""
    if not reference:
        return []
    lines = [f"## Reference figures ({reference.get('source') or 'published'})", ""]
    header = ["task/metric", "reference"] + [h for label in labels for h in (label, f"{label} − ref")]
    lines += _table(header, [[r["key"], r["reference"], *(r[h] for label in labels for h in (label, f"{label}_delta"))]
                             for r in reference["rows"]])
    return lines + [""]


def to_markdown(report: dict[str, Any]) -> str:
    """Render a report (as built by ``build_report``) as Markdown."""
    recipe = report.get("recipe")
    lines = [f"# normswap run: {recipe['name']}" if recipe else "# normswap evaluation", ""]
    if recipe and recipe.get("description"):
        lines += [recipe["description"].strip(), ""]
    settings = report["settings"]
    if report.get("modality") in ("audio", "images"):
        lines.append(f"dtype {settings['dtype']}, batch size {settings['batch_size']}; "
                     f"{report['modality']}: {(report.get('text') or {}).get('name', '–')}")
    else:
        lines.append(
            f"dtype {settings['dtype']}, batch size {settings['batch_size']}, max length "
            f"{report.get('max_length') or settings['max_length']}, stride {settings['stride'] or 'max length'}, "
            f"lm-eval limit {settings['limit'] or 'none'}; text: {(report.get('text') or {}).get('name', '–')}"
        )
    lines.append("")
    models = report["models"]
    for label, model in models.items():
        lines.append(f"- **{label}**: `{model['source']}`")
    lines.append("")
    conversion = report.get("conversion")
    if isinstance(conversion, dict):
        lines += _conversion_lines(conversion)
    comparison = report.get("comparison")
    if comparison:
        lines += _comparison_lines(report, comparison)
    else:
        lines += ["## Scores", ""]
        keys = sorted({k for m in models.values() for k in m["metrics"]})
        if keys:
            lines += _table(["task/metric", *models], [[k, *(m["metrics"].get(k) for m in models.values())] for k in keys])
        else:
            lines.append(f"Nothing to score: {report.get('unscored') or 'no metric was measured'}.")
        lines.append("")
    if report.get("samples"):
        header = list(report["samples"][0])
        per_image = "pooled cosine" in header
        lines += ["## Per image" if per_image else "## Samples", ""]
        lines += _table(header, [[row.get(h) for h in header] for row in report["samples"]])
        lines.append("")
    lines += _reference_lines(report.get("reference"), list(models))
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, *, plot: bool = False) -> dict[str, Path]:
    """Write ``report.json`` and ``report.md`` (and ``report.png``) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json_text(report), encoding="utf-8")
    paths["markdown"].write_text(to_markdown(report) + "\n", encoding="utf-8")
    if plot:
        from normswap.evaluation.plot import plot_report

        paths["plot"] = plot_report(report, out_dir / "report.png")
    return paths
