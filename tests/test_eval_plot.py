"""eval's report.png plots what differs: each metric against its tolerance, and the per-document
differences as a distribution; the comparison keeps that distribution in bounded form."""

from __future__ import annotations

import pytest

from normswap.evaluation.compare import Tolerances, compare_documents, quantiles
from normswap.evaluation.plot import plot_report, tolerance_ratio

TOLERANCES = {"ppl_rtol": 1e-4, "acc_atol": 0.005, "doc_ll_atol": 1e-2}


def test_quantiles_interpolate_between_order_statistics():
    q = quantiles([4.0, 1.0, 3.0, 2.0, 5.0])
    assert q == {"p0": 1.0, "p5": 1.2, "p25": 2.0, "p50": 3.0, "p75": 4.0, "p95": pytest.approx(4.8), "p100": 5.0}
    assert quantiles([]) == {}


def test_each_document_counts_once_with_its_largest_difference():
    original = {0: [-1.0, -2.0], 1: [-3.0], 2: [-4.0]}
    converted = {0: [-1.5, -2.0], 1: [-3.1], 2: [-4.0]}
    row, problem = compare_documents("cloze", original, converted, Tolerances(1e-4, 0.005, 1e-2))
    assert problem is None and row.worst_doc == 0 and row.max_abs_delta_ll == 0.5
    assert row.abs_delta_quantiles["p0"] == 0.0 and row.abs_delta_quantiles["p100"] == 0.5
    assert row.abs_delta_quantiles["p50"] == pytest.approx(0.1)


def test_a_metric_is_measured_in_tolerances():
    perplexity = {"key": "strided/token_perplexity", "delta": -0.02, "rel_delta": -2.7e-4}
    accuracy = {"key": "cloze/acc", "delta": 0.01, "rel_delta": 0.014}
    assert tolerance_ratio(perplexity, TOLERANCES)[0] == pytest.approx(2.7)
    assert tolerance_ratio(accuracy, TOLERANCES)[0] == pytest.approx(2.0)
    assert tolerance_ratio({**accuracy, "delta": 0.0}, TOLERANCES)[0] == 0.0


def report(comparison: bool, reference: bool) -> dict:
    models = {"original": {"source": "a", "metrics": {"strided/token_perplexity": 78.07, "cloze/acc": 0.7}},
              "converted": {"source": "b", "metrics": {"strided/token_perplexity": 78.05, "cloze/acc": 0.7}}}
    data = {"models": models, "verdict": "fail" if comparison else None, "comparison": None, "reference": None}
    if comparison:
        data["comparison"] = {"tolerances": TOLERANCES, "metrics": [
            {"key": "strided/token_perplexity", "delta": -0.02, "rel_delta": -2.6e-4, "ok": False},
            {"key": "cloze/acc", "delta": 0.0, "rel_delta": 0.0, "ok": True}],
            "documents": [{"task": "cloze", "n_docs": 3, "max_abs_delta_ll": 0.5, "worst_doc": 0, "ok": False,
                           "abs_delta_quantiles": quantiles([0.0, 0.1, 0.5])},
                          {"task": "exact", "n_docs": 2, "max_abs_delta_ll": 0.0, "worst_doc": 0, "ok": True,
                           "abs_delta_quantiles": quantiles([0.0, 0.0])}]}
    if reference:
        data["reference"] = {"source": "paper", "rows": [{"key": "cloze/acc", "reference": 0.71, "original": 0.7,
                                                          "converted": 0.7}]}
    return data


@pytest.mark.parametrize(("comparison", "reference"), [(True, True), (True, False), (False, False)])
def test_report_png_is_written_for_every_kind_of_report(tmp_path, comparison, reference):
    pytest.importorskip("matplotlib")
    path = plot_report(report(comparison, reference), tmp_path / "report.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
