"""One call for the whole evaluation: score the model(s), compare, build the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from normswap.arguments import checked
from normswap.evaluation.compare import Comparison, Tolerances, compare, default_tolerances
from normswap.evaluation.media_eval import check_sources, evaluate_media, media_kind
from normswap.evaluation.report import build_report
from normswap.evaluation.runner import EvalSettings, Evaluator, ModelEval


@checked
def evaluate(
    model: str | Path,
    *,
    baseline: str | Path | None = None,
    settings: EvalSettings | None = None,
    tolerances: Tolerances | None = None,
    reference: dict[str, float] | None = None,
    reference_source: str | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` (and ``baseline`` first, under identical settings); return the report.

    With a baseline, the report carries a comparison with deltas, per-document maxima and a
    ``verdict`` of ``"pass"`` or ``"fail"``; without one it lists the scores.
    """
    settings = settings or EvalSettings()

    if media_kind(settings) is not None:
        return evaluate_media(model, baseline=baseline, settings=settings, tolerances=tolerances,
                              reference=reference, reference_source=reference_source)
    # Speech and vision models read audio or images, encoder-decoders have no causal score: say so
    # before loading anything.
    check_sources([m for m in (baseline, model) if m is not None], None, settings.trust_remote_code,
                  causal_text=True)
    evaluator = Evaluator(settings, workdir=workdir)
    try:
        results: list[ModelEval] = (list(evaluator.evaluate_pair(str(baseline), str(model))) if baseline is not None
                                    else [evaluator.evaluate("model", str(model))])
    finally:
        evaluator.close()
    comparison: Comparison | None = None
    if baseline is not None:
        comparison = compare(results[0], results[1], tolerances or default_tolerances(settings.dtype))
    text = None
    if evaluator.text is not None:
        text = {"name": evaluator.text.name, "documents": len(evaluator.text.documents), **evaluator.text.origin}
    return build_report(
        results, settings, comparison=comparison, reference=reference, reference_source=reference_source,
        text=text, extra={"max_length": evaluator.max_length, "tasks": evaluator.plan.all},
    )
