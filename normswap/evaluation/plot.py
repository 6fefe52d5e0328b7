"""``report.png``: what differs between the two models, against the tolerances the verdict uses.

With a comparison the chart has two panels:

* every metric's difference as a multiple of its tolerance, |rel Δ| / ppl_rtol for perplexities
  and bits per byte, |Δ| / acc_atol otherwise: a bar past 1 is a failure;
* per task, the distribution of the per-document |Δ loglikelihood| (box p25-p75, whiskers p5-p95,
  median tick, worst document as a dot) on a log scale, with the tolerance as a line;
* with published reference figures, each model's relative difference from them.

Both use log scales: an exact conversion sits orders of magnitude left of the line, a broken one
on or past it. A difference of exactly 0 is drawn at the axis floor and labelled 0. Without a
comparison the chart shows each metric's value.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from normswap.evaluation.compare import is_relative
from normswap.extras import require

PASS_COLOUR, FAIL_COLOUR, LINE_COLOUR = "#55a868", "#c44e52", "#333333"


def _pyplot():

    require("plot", "report.png")
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def tolerance_ratio(row: dict[str, Any], tolerances: dict[str, float]) -> tuple[float, str]:
    """A metric row's |Δ| as a multiple of its tolerance, and its difference as text."""
    if is_relative(row["key"]) and row.get("rel_delta") is not None:
        limit, delta, text = tolerances["ppl_rtol"], row["rel_delta"], f"rel Δ {row['rel_delta']:.2e}"
    else:
        limit, delta, text = tolerances["acc_atol"], row["delta"], f"Δ {row['delta']:.3g}"
    if not math.isfinite(delta):
        return math.inf, text
    if limit == 0:
        return (0.0 if delta == 0 else math.inf), text
    return abs(delta) / limit, text


def _floor(values: list[float]) -> float:
    """The left edge of a log axis: a decade below the smallest positive value shown."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    return 10 ** math.floor(math.log10(min(positive)) - 1) if positive else 1e-12


def _metric_panel(ax, comparison: dict[str, Any]) -> None:
    rows = comparison["metrics"]
    ratios = [tolerance_ratio(row, comparison["tolerances"]) for row in rows]
    floor = _floor([r for r, _ in ratios] + [1.0])
    finite_max = max([r for r, _ in ratios if math.isfinite(r)] + [1.0])
    ceiling = 10 ** math.ceil(math.log10(finite_max) + 0.5)
    for y, (row, (ratio, text)) in enumerate(zip(rows, ratios, strict=True)):
        shown = min(max(ratio, floor), ceiling)
        ax.barh(y, shown - floor, left=floor, color=PASS_COLOUR if row["ok"] else FAIL_COLOUR, height=0.6)
        ax.text(shown * 1.15, y, "Δ 0" if ratio == 0 else text, va="center", fontsize=7)
    ax.axvline(1.0, color=LINE_COLOUR, linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(floor, ceiling * 30)
    ax.set_yticks(range(len(rows)), [row["key"] for row in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("|Δ| / tolerance (dashed line: the tolerance; past it fails)", fontsize=8)
    ax.set_title("each metric's difference against its tolerance", fontsize=9)


def _document_panel(ax, comparison: dict[str, Any]) -> None:
    documents = [d for d in comparison["documents"] if d.get("abs_delta_quantiles")]
    limit = comparison["tolerances"]["doc_ll_atol"]
    values = [v for d in documents for v in d["abs_delta_quantiles"].values()]
    floor = _floor(values + [limit])
    top = max([v for v in values if math.isfinite(v)] + [limit])
    for y, doc in enumerate(documents):
        q = {k: min(max(v, floor), top * 10) for k, v in doc["abs_delta_quantiles"].items()}
        colour = PASS_COLOUR if doc["ok"] else FAIL_COLOUR
        ax.plot([q["p5"], q["p95"]], [y, y], color=colour, linewidth=1)
        ax.barh(y, q["p75"] - q["p25"], left=q["p25"], height=0.5, color=colour, alpha=0.5, edgecolor=colour)
        ax.plot([q["p50"], q["p50"]], [y - 0.25, y + 0.25], color=LINE_COLOUR, linewidth=1.5)
        ax.plot(q["p100"], y, "o", color=colour, markersize=4)
        worst = doc["max_abs_delta_ll"]
        ax.text(q["p100"] * 1.3, y, "max 0" if worst == 0 else f"max {worst:.2e} (doc {doc['worst_doc']})",
                va="center", fontsize=7)
    ax.axvline(limit, color=LINE_COLOUR, linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(floor, top * 1e3)
    ax.set_yticks(range(len(documents)), [f"{d['task']} ({d['n_docs']})" for d in documents], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"per-document |Δ loglik|, nats (dashed line: tolerance {limit:g})", fontsize=8)
    ax.set_title("per-document differences: box p25–p75, whiskers p5–p95, dot the worst", fontsize=9)


def _reference_panel(ax, report: dict[str, Any]) -> None:
    """Each model's relative difference from the published figure, per metric."""
    rows = report["reference"]["rows"]
    labels = list(report["models"])
    height = 0.8 / max(1, len(labels))
    for index, label in enumerate(labels):
        values = [(row[label] - row["reference"]) / row["reference"] if row.get(label) is not None and row["reference"]
                  else float("nan") for row in rows]
        ax.barh([y + index * height for y in range(len(rows))], values, height=height, label=label)
    ax.axvline(0.0, color=LINE_COLOUR, linewidth=1)
    ax.set_yticks(range(len(rows)), [row["key"] for row in rows], fontsize=7)
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    ax.set_xlabel("(model − published) / published", fontsize=8)
    ax.set_title(f"against the published figures ({report['reference'].get('source') or 'reference'})", fontsize=9)


def _scores_panel(ax, report: dict[str, Any]) -> None:
    """One model (no baseline): each metric's value."""
    models = report["models"]
    keys = sorted({k for m in models.values() for k in m["metrics"]})
    labels = list(models)
    height = 0.8 / max(1, len(labels))
    for index, label in enumerate(labels):
        values = [models[label]["metrics"].get(k, float("nan")) for k in keys]
        ax.barh([y + index * height for y in range(len(keys))], values, height=height, label=label)
    ax.set_yticks(range(len(keys)), keys, fontsize=7)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    ax.set_title("scores", fontsize=9)


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Write ``report.png`` for a report built by ``normswap.evaluation.report.build_report``."""
    plt = _pyplot()
    comparison = report.get("comparison")
    documents = [d for d in (comparison or {}).get("documents", []) if d.get("abs_delta_quantiles")]
    metrics = (comparison or {}).get("metrics") or []
    reference = (report.get("reference") or {}).get("rows") or []
    panels = [(_metric_panel, comparison, len(metrics))] if metrics else [(_scores_panel, report, 1)]
    if metrics and documents:
        panels.append((_document_panel, comparison, len(documents)))
    if reference:
        panels.append((_reference_panel, report, len(reference)))
    heights = [max(rows, 1) for _, _, rows in panels]
    fig, axes = plt.subplots(len(heights), 1, figsize=(9, 1.2 + 0.32 * sum(heights) + 0.8 * len(heights)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    for (draw, data, _), row in zip(panels, axes, strict=True):
        draw(row[0], data)
    verdict = report.get("verdict")
    models = " vs ".join(f"{label}: {m['source']}" for label, m in report["models"].items())
    fig.suptitle(("normswap eval" + (f": {verdict.upper()}" if verdict else "")) + f"\n{models}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
