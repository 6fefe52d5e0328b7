"""Strided perplexity, text sources, comparison and report: fast, offline, no lm-eval."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from normswap.errors import NormswapError
from normswap.evaluation import hub
from normswap.evaluation.compare import Tolerances, compare, compare_metric, default_tolerances
from normswap.evaluation.perplexity import plan_windows, strided_perplexity
from normswap.evaluation.report import build_report, to_markdown, write_report
from normswap.evaluation.runner import EvalSettings, ModelEval
from normswap.evaluation.text import load_text

VOCAB = 61


def tiny_gpt2(dtype: torch.dtype = torch.float64, n_positions: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).eval().to(dtype)
    with torch.no_grad():  # sharper than the init so that perplexity is far from uniform
        model.lm_head.weight.mul_(8.0)
    return model


def independent_nll(model: torch.nn.Module, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """Token by token, in float64: token i is predicted from the start of the first window reaching it."""
    total, count = 0.0, 0
    for i in range(1, ids.numel()):
        k = max(0, math.ceil((i - max_length + 1) / stride))
        begin = k * stride
        if begin == i:  # first token of a window that no earlier window reached: never scored
            continue
        with torch.no_grad():
            logits = model(input_ids=ids[begin : i].unsqueeze(0)).logits[0, -1].double()
        total -= torch.log_softmax(logits, -1)[ids[i]].item()
        count += 1
    return total, count


@pytest.mark.parametrize("n, max_length, stride", [(150, 32, 12), (150, 32, 32), (97, 40, 1), (10, 64, 64)])
def test_windows_score_each_token_once(n, max_length, stride):
    scored = [t for w in plan_windows(n, max_length, stride) for t in range(w.score_from, w.end)]
    assert scored == sorted(set(scored))
    skipped = set(range(1, n)) - set(scored)
    # Only the first token of a non-overlapping window goes unscored (as in the transformers docs).
    assert skipped == ({t for t in range(max_length, n, stride)} if stride == max_length else set())
    assert all(w.end - w.begin <= max_length for w in plan_windows(n, max_length, stride))


@pytest.mark.parametrize("stride", [10, 24])
def test_strided_equals_float64_recomputation(stride):
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(3))
    total, count = independent_nll(model, ids, 24, stride)
    for batch_size in (1, 3):
        result = strided_perplexity(model, ids, max_length=24, stride=stride, batch_size=batch_size)
        assert result.n_tokens == count
        assert result.nll_sum == pytest.approx(total, rel=1e-12)
        assert result.token_perplexity == pytest.approx(math.exp(total / count), rel=1e-12)
    # fp32 weights and activations: the same figure up to float32 rounding
    fp32 = strided_perplexity(tiny_gpt2(torch.float32), ids, max_length=24, stride=stride, batch_size=2)
    assert fp32.token_perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_matches_transformers_docs_loop_at_full_stride():
    """At stride == max_length the documentation's loss-based loop gives the same number."""
    model = tiny_gpt2()
    ids = torch.randint(0, VOCAB, (1, 130), generator=torch.Generator().manual_seed(4))
    max_length = stride = 32
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, ids.size(1), stride):
        end = min(begin + max_length, ids.size(1))
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        num_loss_tokens = (target_ids != -100).sum().item() - target_ids.size(0)
        nll_sum += loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end = end
        if end == ids.size(1):
            break
    ours = strided_perplexity(model, ids[0], max_length=max_length, stride=stride, batch_size=2)
    assert ours.n_tokens == n_tokens
    # the HF loss computes in float32 even for a float64 model
    assert ours.token_perplexity == pytest.approx(math.exp(nll_sum / n_tokens), rel=1e-6)


def test_bad_windows_are_user_errors():
    model = tiny_gpt2()
    with pytest.raises(NormswapError, match="stride"):
        strided_perplexity(model, torch.arange(20), max_length=8, stride=9)
    with pytest.raises(NormswapError, match="too short"):
        strided_perplexity(model, torch.tensor([1]), max_length=8, stride=8)


def test_text_sources(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("First para\nwrapped.\n\nSecond para.\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("Third.", encoding="utf-8")
    single = load_text(tmp_path / "a.txt")
    assert single.joined == "First para\nwrapped.\n\nSecond para."
    both = load_text(tmp_path)
    assert both.joined.endswith("Second para.\n\nThird.") and len(both.documents) == 2
    with pytest.raises(NormswapError, match="not a file, a directory"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NormswapError, match="no .txt files"):
        load_text(tmp_path / "empty")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(NormswapError, match="not UTF-8"):
        load_text(tmp_path / "bad.txt")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(NormswapError, match="hub"):
        load_text("wikitext-2-raw-v1")


def _model_eval(label, metrics, per_doc):
    return ModelEval(label=label, source=label, metrics=metrics, per_doc=per_doc)


def test_comparison_verdict_and_per_document_maximum():
    tol = Tolerances(ppl_rtol=1e-4, acc_atol=0.005, doc_ll_atol=1e-2)
    original = _model_eval("original", {"t/word_perplexity": 20.0, "t/acc": 0.5},
                           {"t": {0: [-10.0], 1: [-20.0, -21.0]}})
    same = _model_eval("converted", {"t/word_perplexity": 20.0001, "t/acc": 0.5},
                       {"t": {0: [-10.001], 1: [-20.0, -21.004]}})
    result = compare(original, same, tol)
    assert result.passed
    assert result.documents[0].max_abs_delta_ll == pytest.approx(0.004)
    assert result.documents[0].worst_doc == 1
    worse = _model_eval("converted", {"t/word_perplexity": 21.0, "t/acc": 0.5},
                        {"t": {0: [-10.5], 1: [-20.0, -21.0]}})
    failed = compare(original, worse, tol)
    assert not failed.passed
    assert [r.ok for r in failed.rows] == [False, True]
    assert not failed.documents[0].ok
    assert not compare_metric("t/acc", 0.5, 0.52, tol).ok
    assert default_tolerances("bf16").ppl_rtol > default_tolerances("fp32").ppl_rtol


def test_report_markdown_json_and_plot(tmp_path):
    original = _model_eval("original", {"strided/token_perplexity": 12.0}, {"strided": {0: [-5.0]}})
    converted = _model_eval("converted", {"strided/token_perplexity": 12.0}, {"strided": {0: [-5.0]}})
    comparison = compare(original, converted, default_tolerances("float32"))
    report = build_report([original, converted], EvalSettings(), comparison=comparison,
                          reference={"strided/token_perplexity": 11.5}, reference_source="docs")
    markdown = to_markdown(report)
    assert "Comparison: PASS" in markdown and "| strided/token_perplexity | 12 | 12 | 0 |" in markdown
    assert "Reference figures (docs)" in markdown
    paths = write_report(report, tmp_path, plot=True)
    assert json.loads(paths["json"].read_text())["verdict"] == "pass"
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
