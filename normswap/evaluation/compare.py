"""Compare a converted model with its original: metric deltas, per-document deltas, a verdict.

Aggregates can hide compensating errors, so besides each metric's delta the comparison takes, for
every task, the largest per-document difference of loglikelihood,

    max_d |LL_conv(d) - LL_orig(d)|      (nats; per choice for multiple-choice tasks)

from the samples lm-eval logged (and from the per-window NLL of the strided perplexity).

Tolerances. Perplexity-like metrics (perplexity, bits per byte) are compared relatively,
accuracies absolutely, per-document loglikelihoods absolutely. The defaults depend on the dtype:
an exact conversion evaluated in fp32 differs from its original by float rounding only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from normswap.dtypes import canonical_name
from normswap.evaluation.runner import ModelEval

# Metric names compared relatively (lower is better, scale-free).
RELATIVE_METRICS = ("perplexity", "bits_per_byte")


@dataclass
class Tolerances:
    """Pass/fail limits for a comparison."""

    ppl_rtol: float = 1e-4  # |Δ| / original for perplexities and bits per byte
    acc_atol: float = 0.005  # |Δ| for accuracies and any other metric
    doc_ll_atol: float = 1e-2  # max per-document |Δ loglikelihood| in nats

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Loose enough for rounding in the dtype, tight enough that a broken conversion fails by orders of
# magnitude (a wrong fold typically moves perplexity by percents).
DEFAULT_TOLERANCES: dict[str, Tolerances] = {
    "float64": Tolerances(1e-6, 0.0, 1e-4),
    "float32": Tolerances(1e-4, 0.005, 1e-2),
    "float16": Tolerances(5e-3, 0.02, 1.0),
    "bfloat16": Tolerances(2e-2, 0.03, 4.0),
}


def default_tolerances(dtype: str) -> Tolerances:
    """Default tolerances for evaluating both models in ``dtype``."""

    canonical = canonical_name(dtype)
    return Tolerances(**asdict(DEFAULT_TOLERANCES[canonical]))


def is_relative(metric: str) -> bool:
    """True for metrics compared relatively (perplexities, bits per byte)."""
    return any(name in metric for name in RELATIVE_METRICS)


@dataclass
class MetricRow:
    key: str  # task/metric
    original: float
    converted: float
    delta: float
    rel_delta: float | None
    limit: str
    ok: bool


@dataclass
class DocRow:
    task: str
    n_docs: int
    max_abs_delta_ll: float
    worst_doc: int | None
    limit: float
    ok: bool
    # the distribution of the per-document |Δ| (each document's largest over its scores):
    # percentile ("p0", "p5", ... "p100") -> nats, which the report's plot draws
    abs_delta_quantiles: dict[str, float] = field(default_factory=dict)


# the percentiles of the per-document |Δ loglik| a comparison keeps (a bounded summary of any task size)
DOC_PERCENTILES = (0, 5, 25, 50, 75, 95, 100)


def quantiles(values: list[float], percentiles: tuple[int, ...] = DOC_PERCENTILES) -> dict[str, float]:
    """Percentiles of ``values`` by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return {}
    result = {}
    for p in percentiles:
        position = (len(ordered) - 1) * p / 100
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        below, above = ordered[low], ordered[high]
        result[f"p{p}"] = below if below == above else below + (above - below) * (position - low)
    return result


@dataclass
class Comparison:
    rows: list[MetricRow] = field(default_factory=list)
    documents: list[DocRow] = field(default_factory=list)
    tolerances: Tolerances = field(default_factory=Tolerances)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.ok for r in self.rows) and all(d.ok for d in self.documents)

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "tolerances": self.tolerances.as_dict(),
            "metrics": [asdict(r) for r in self.rows],
            "documents": [asdict(d) for d in self.documents],
            "problems": list(self.problems),
        }


def compare_metric(key: str, original: float, converted: float, tol: Tolerances) -> MetricRow:
    """One metric's delta and whether it is within tolerance."""
    delta = converted - original
    rel = delta / original if original else None
    if is_relative(key):
        ok = abs(rel) <= tol.ppl_rtol if rel is not None else delta == 0
        limit = f"rel ≤ {tol.ppl_rtol:g}"
    else:
        ok = abs(delta) <= tol.acc_atol
        limit = f"abs ≤ {tol.acc_atol:g}"
    if not (math.isfinite(original) and math.isfinite(converted)):
        ok = original == converted
    return MetricRow(key, original, converted, delta, rel, limit, bool(ok))


def compare_documents(task: str, original: dict[int, list[float]], converted: dict[int, list[float]],
                      tol: Tolerances) -> tuple[DocRow, str | None]:
    """Largest per-document |Δ loglikelihood| of one task, and a problem if the documents differ."""
    common = sorted(set(original) & set(converted))
    problem = None
    if set(original) != set(converted):
        problem = f"{task}: the two models were scored on different documents"
    worst, worst_doc = 0.0, None
    per_document = []
    for doc in common:
        a, b = original[doc], converted[doc]
        if len(a) != len(b):
            problem = f"{task}: document {doc} has a different number of scores"
            continue
        gaps = [abs(y - x) if math.isfinite(x) and math.isfinite(y) else (0.0 if x == y else math.inf)
                for x, y in zip(a, b, strict=True)]
        if gaps:
            per_document.append(max(gaps))
            if worst_doc is None or max(gaps) > worst:
                worst, worst_doc = max(gaps), doc
    row = DocRow(task, len(common), worst, worst_doc, tol.doc_ll_atol, worst <= tol.doc_ll_atol,
                 quantiles(per_document))
    return row, problem


def compare(original: ModelEval, converted: ModelEval, tol: Tolerances) -> Comparison:
    """Compare every metric and every task's documents present for both models."""
    result = Comparison(tolerances=tol)
    for key in original.metrics:
        if key in converted.metrics:
            result.rows.append(compare_metric(key, original.metrics[key], converted.metrics[key], tol))
    missing = sorted(set(original.metrics) ^ set(converted.metrics))
    if missing:
        result.problems.append(f"metrics present for only one model: {', '.join(missing)}")
    for task in original.per_doc:
        if task in converted.per_doc:
            row, problem = compare_documents(task, original.per_doc[task], converted.per_doc[task], tol)
            result.documents.append(row)
            if problem:
                result.problems.append(problem)
    return result


def reference_rows(reference: dict[str, float], models: list[ModelEval]) -> list[dict[str, Any]]:
    """Published figures next to ours: ``{key, reference, <label>: value, <label>_delta: ours - ref}``."""
    rows = []
    for key, ref in reference.items():
        row: dict[str, Any] = {"key": key, "reference": ref}
        for model in models:
            value = model.metrics.get(key)
            row[model.label] = value
            row[f"{model.label}_delta"] = None if value is None else value - ref
        rows.append(row)
    return rows
