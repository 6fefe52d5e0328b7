"""The two models of a comparison scored side by side (``Evaluator.evaluate_pair``): the baseline in
a forked copy, the model here, with the scores of one model after the other."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
from tqdm import tqdm

pytest.importorskip("lm_eval")

from normswap.checkpoint.source import EXAMPLE_MODEL, example_model_path  # noqa: E402
from normswap.errors import NormswapError  # noqa: E402
from normswap.evaluation import runner  # noqa: E402
from normswap.evaluation.runner import EvalSettings, Evaluator, ModelEval  # noqa: E402
from normswap.runtime import background  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="side by side needs Linux's fork")


@pytest.fixture
def copies(monkeypatch) -> list:
    """Two idle cores whatever the machine's load, and the forked copies evaluate_pair starts."""
    monkeypatch.setattr(runner, "default_threads", lambda: 2)
    made: list = []
    real = background.InProcess

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(background, "InProcess", spy)
    return made


def pair(**changes) -> tuple[ModelEval, ModelEval]:
    if not (example_model_path() / "config.json").is_file():
        pytest.skip("the bundled model is missing")
    settings = EvalSettings(**{"tasks": ["local"], "limit": 4, "device": "cpu", "progress": False, **changes})
    evaluator = Evaluator(settings)
    try:
        return evaluator.evaluate_pair(EXAMPLE_MODEL, EXAMPLE_MODEL)
    finally:
        evaluator.close()


def test_side_by_side_scores_as_one_at_a_time(copies, capfd, monkeypatch):
    score = Evaluator._score

    def bars_noted(self, result, model, tokenizer):  # lm-eval's request building passes no disable=
        result.details["bars_off"] = tqdm(total=1).disable
        score(self, result, model, tokenizer)

    monkeypatch.setattr(Evaluator, "_score", bars_noted)
    beside = pair()
    assert len(copies) == 1 and copies[0].done()
    assert "fork" not in capfd.readouterr().err  # nor any library's warning about one
    assert beside[0].details.pop("bars_off") is True  # the copy's would be drawn over the model's
    alone = pair(side_by_side=False)
    assert len(copies) == 1
    assert [m.details.pop("side_by_side") for m in (*beside, *alone)] == [True, True, False, False]
    for side, one in zip(beside, alone, strict=True):
        assert (side.label, side.source) == (one.label, one.source)
        assert side.metrics == pytest.approx(one.metrics, rel=1e-6)
        assert set(side.per_doc) == set(one.per_doc) and "strided" in side.per_doc
        for task, documents in one.per_doc.items():
            assert set(side.per_doc[task]) == set(documents)
            for doc, values in documents.items():  # one core or two: float32 sums in another order
                assert side.per_doc[task][doc] == pytest.approx(values, abs=1e-4, rel=2e-7), (task, doc)
        assert side.details["lm_eval_docs"] == one.details["lm_eval_docs"]


def test_model_eval_comes_back_from_json_exactly():
    result = ModelEval("original", "src", metrics={"t/acc": 0.1 + 0.2, "t/stderr": "N/A"},
                       per_doc={"t": {3: [-1.2345678901234567, -0.5]}, "strided": {0: [-7.0]}},
                       details={"seconds": 1.5, "lm_eval_docs": {"t": 1}})
    assert ModelEval.from_json(json.loads(json.dumps(result.as_json()))) == result


@pytest.mark.parametrize("changes, cores, side_by_side", [
    ({}, 2, True), ({}, 3, True), ({}, 1, False), ({}, 4, False), ({}, None, False),
    ({"threads": 2}, 2, False), ({"side_by_side": False}, 2, False), ({"share_contexts": False}, 2, False),
    ({"device": "cuda"}, 2, False), ({"device_map": "auto"}, 2, False),
], ids=["two-cores", "three-cores", "one-core", "four-cores", "user-threads", "threads-set", "one-at-a-time",
        "plain-lm-eval", "gpu", "device-map"])
def test_side_by_side_only_on_two_or_three_idle_cpu_cores(monkeypatch, changes, cores, side_by_side):
    monkeypatch.setattr(runner, "default_threads", lambda: cores)
    evaluator = Evaluator(EvalSettings(perplexity=False, progress=False, **changes))
    try:
        assert (evaluator._side_by_side_cores() is not None) is side_by_side
    finally:
        evaluator.close()


def test_models_too_big_for_memory_twice_take_turns(copies, monkeypatch):
    monkeypatch.setattr(runner, "available_memory", lambda: 1 << 20)
    original, converted = pair(perplexity=False, tasks=["persuasion_lastword"])
    assert copies == [] and original.per_doc and converted.per_doc
    assert original.details["side_by_side"] is converted.details["side_by_side"] is False


def test_a_copy_that_dies_stops_the_model_at_its_next_forward_pass(copies, monkeypatch):
    monkeypatch.setattr(runner._ScoredAlone, "work_alone", lambda self: os._exit(3))
    reached = []

    def scored_after_the_death(self, result, model, tokenizer):
        assert result.label == "converted"
        for _ in range(600):
            if copies[0].done():
                break
            time.sleep(0.05)
        model(input_ids=torch.tensor([[1, 2]]))
        reached.append(result.label)

    monkeypatch.setattr(Evaluator, "_score", scored_after_the_death)
    with pytest.raises(NormswapError, match=r"^the process of the evaluation of .+ exited with status 3 before it"):
        pair(perplexity=False, tasks=["persuasion_lastword"])
    assert reached == []


@pytest.mark.parametrize("failing", ["original", "converted"])
def test_a_failure_on_either_side_is_its_own_one_line_error(copies, monkeypatch, failing):
    score = Evaluator._score

    def failing_score(self, result, model, tokenizer):
        if result.label == failing:
            raise NormswapError(f"cannot score the {failing} model")
        score(self, result, model, tokenizer)

    monkeypatch.setattr(Evaluator, "_score", failing_score)
    with pytest.raises(NormswapError, match=f"^cannot score the {failing} model$"):
        pair(perplexity=False, tasks=["persuasion_lastword"])
    assert len(copies) == 1 and copies[0]._read == -1  # the copy answered, or was ended, and is reaped
