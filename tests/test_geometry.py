"""normswap geometry: statistics of norm inputs relative to the all-ones direction.

Tiny GPT-2 models are built whose residual stream lies exactly orthogonal to 1 (every writer
centred) or not (embeddings and projection biases carrying a large mean, plus one massive dimension).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import normswap
from normswap.analysis import cli as geometry_cli
from normswap.analysis import stats
from normswap.analysis.collect import classify, find_norms, run_geometry
from normswap.analysis.report import build_report, format_comparison, format_report
from normswap.errors import NormswapError

D = 16
VOCAB = 64
MASSIVE_DIM = 5


def tiny_gpt2(seed: int = 0, *, mean: float = 0.0, dtype: torch.dtype = torch.float64) -> GPT2LMHeadModel:
    """A random 2-layer GPT-2 whose writers carry ``mean`` along 1 and whose γ/β are far from 1/0."""
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=VOCAB, n_positions=32,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 2.0)
                module.bias.normal_(0.0, 0.3)
        model.transformer.wte.weight.add_(mean)
        model.transformer.wte.weight[:, MASSIVE_DIM] += 4 * mean  # a GPT-2-like massive dimension
        model.transformer.wpe.weight.add_(mean / 2)
        for block in model.transformer.h:
            block.attn.c_proj.bias.add_(mean)
            block.mlp.c_proj.bias.add_(-mean / 3)
    return model


def centre_writers(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    """Centre every tensor that writes the residual stream along the hidden dimension (in place).

    Embedding rows ([V, d]) and Conv1D projections ([in, d]) both have the hidden dimension last.
    The head is untied, so the logits' dependence on the residual is unchanged apart from centring.
    """
    writers = [model.transformer.wte.weight, model.transformer.wpe.weight]
    for block in model.transformer.h:
        writers += [block.attn.c_proj.weight, block.attn.c_proj.bias, block.mlp.c_proj.weight, block.mlp.c_proj.bias]
    with torch.no_grad():
        for tensor in writers:
            tensor.sub_(tensor.mean(-1, keepdim=True))
    return model


def token_ids(n: int = 96, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids.reshape(-1, 32)).logits


def by_name(norms: list[dict]) -> dict[str, dict]:
    return {n["name"]: n for n in norms}


# --- the pure statistics, against hand-computed values ---------------------------------------------

# x = [3, 1, 1, -1]: μ = 1, ‖x‖ = √12, x - μ = [2, 0, 0, -2], std = √2, RMS = √3.
X_MEAN = torch.tensor([[3.0, 1.0, 1.0, -1.0]])
# Orthogonal to 1: μ = 0.
X_ORTH = torch.tensor([[1.0, -1.0, 2.0, -2.0]])


def test_cos_share_and_ratio_match_hand_computed_values():
    assert stats.cos_to_ones(X_MEAN).item() == pytest.approx(1 / math.sqrt(3), abs=1e-15)  # μ√d/‖x‖ = 2/√12
    assert stats.cos_to_ones(-X_MEAN).item() == pytest.approx(-1 / math.sqrt(3), abs=1e-15)
    assert stats.mean_share(-X_MEAN).item() == pytest.approx(1 / math.sqrt(3), abs=1e-15)
    assert stats.rms_std_ratio(X_MEAN).item() == pytest.approx(math.sqrt(1.5), abs=1e-15)  # √3/√2
    assert stats.cos_to_ones(X_ORTH).item() == 0.0
    assert stats.rms_std_ratio(X_ORTH).item() == 1.0
    assert stats.cos_to_ones(torch.zeros(1, 4)).item() == 0.0  # no direction, no nan
    both = torch.cat([X_MEAN, X_ORTH])
    assert stats.pooled_mean_share(both) == pytest.approx(math.sqrt(4 / 22), abs=1e-15)  # Σdμ² / Σ‖x‖²


def test_isotropic_yardstick():
    assert stats.isotropic_mean_abs_cos(2) == pytest.approx(2 / math.pi, abs=1e-15)  # E|cos| on the circle
    assert stats.isotropic_mean_abs_cos(3) == pytest.approx(0.5, abs=1e-15)  # cos θ uniform on [-1, 1]
    assert stats.isotropic_mean_abs_cos(768) == pytest.approx(math.sqrt(2 / (math.pi * 768)), rel=1e-3)


def test_naive_swap_error_matches_hand_computed_value():
    # γ = 1, β = 0, eps = 0: LN(x) = √d·x⊥/‖x⊥‖ and RMSNorm(x) = √d·x/‖x‖, at angle 90° - θ, so the
    # relative error is sqrt(2 - 2|sin θ|) with sin θ = √(2/3).
    expected = math.sqrt(2 - 2 * math.sqrt(2 / 3))
    assert stats.naive_swap_error(X_MEAN, eps=0.0).item() == pytest.approx(expected, abs=1e-14)
    gamma, beta = torch.tensor([2.0, 0.5, 1.0, 3.0]), torch.tensor([0.1, -0.2, 0.3, 0.0])
    for eps in (0.0, 1e-5, 0.3):
        assert stats.naive_swap_error(X_ORTH, gamma, beta, eps).item() < 1e-15
        direct = torch.nn.functional.layer_norm(X_MEAN.double(), (4,), gamma.double(), beta.double(), eps)
        assert torch.allclose(stats.layer_norm(X_MEAN, gamma, beta, eps), direct, atol=1e-14)


def test_mean_dimension_contributions_sum_to_one():
    acc = stats.MeanDimAccumulator(4)
    acc.update(X_MEAN)  # c_i = x_i μ / (d μ²) = x_i / 4
    assert torch.allclose(acc.contributions(), torch.tensor([0.75, 0.25, 0.25, -0.25], dtype=torch.float64))
    massive = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    massive[:, 2] += 10.0  # one dimension carries the mean, as GPT-2's massive activations do
    acc.update(massive)
    assert acc.contributions().sum().item() == pytest.approx(1.0, abs=1e-12)
    assert acc.top(1)[0]["dim"] == 2 and acc.top(1)[0]["share_of_mean"] > 0.8


def test_summary_and_correlations():
    values = torch.arange(101, dtype=torch.float64)
    summary = stats.summarise(values)
    assert (summary["mean"], summary["p5"], summary["p50"], summary["p95"], summary["max"]) == (50, 5, 50, 95, 100)
    assert stats.pearson([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(1.0)
    assert stats.spearman([0, 1, 2, 3], [1, 10, 100, 1000]) == pytest.approx(1.0)
    assert stats.spearman([0, 1, 2, 3], [4, 3, 3, 1]) == pytest.approx(-0.9486832980505138)
    assert stats.slope([0, 1, 2], [1, 3, 5]) == pytest.approx(2.0)


# --- hooks on real models ------------------------------------------------------------------------


def test_recorded_statistics_are_those_of_the_norm_inputs():
    model = tiny_gpt2(mean=0.7)
    with torch.no_grad():
        model.transformer.wpe.weight.zero_()  # layer 0's first norm then reads exactly wte[ids]
    ids = token_ids()
    norms = run_geometry(model, ids, seq_len=32)
    assert [n["name"] for n in norms] == [name for name, _ in find_norms(model)]
    assert [(n["layer"], n["kind"]) for n in norms] == [(0, "attention"), (0, "mlp"), (1, "attention"), (1, "mlp"),
                                                        (None, "final")]
    first = norms[0]
    x = model.transformer.wte.weight[ids].double()
    ln = model.transformer.h[0].ln_1
    assert first["tokens"] == ids.numel()
    assert first["cos"]["mean"] == pytest.approx(stats.cos_to_ones(x).mean().item(), abs=1e-14)
    assert first["pooled_share"] == pytest.approx(stats.pooled_mean_share(x), abs=1e-14)
    error = stats.naive_swap_error(x, ln.weight, ln.bias, ln.eps)
    assert first["naive_error"]["p95"] == pytest.approx(torch.quantile(error, 0.95).item(), abs=1e-14)
    assert first["mean_dims"][0]["dim"] == MASSIVE_DIM  # 5x the mean of any other dimension


def test_positions_are_classified():
    assert classify("transformer.h.3.ln_1") == classify("model.layers.3.input_layernorm")
    assert classify("model.decoder.layers.2.encoder_attn_layer_norm").kind == "cross"
    assert classify("model.encoder.layers.1.final_layer_norm").stack == "encoder"
    assert classify("model.encoder.layers.1.final_layer_norm").kind == "mlp"
    assert classify("model.decoder.layer_norm").kind == "final"
    assert classify("transformer.word_embeddings_layernorm").kind == "embedding"


def test_converted_model_mean_share_is_floating_point_noise():
    ids = token_ids()
    original = tiny_gpt2(mean=0.7, dtype=torch.float32)
    converted = normswap.convert_model(original)
    reports = {}
    for label, model in (("original", original), ("converted", converted)):
        norms = run_geometry(model, ids, seq_len=32)
        reports[label] = build_report(norms, model=label, dtype=torch.float32, tokens=ids.numel(), text="random")
    assert all(n["mean_share"] > 0.3 for n in reports["original"]["norms"])
    assert all(n["abs_cos"]["max"] < 1e-6 for n in reports["converted"]["norms"])
    assert reports["converted"]["overall"]["mean_at_noise"] and not reports["original"]["overall"]["mean_at_noise"]
    assert all(abs(n["rms_over_std"]["mean"] - 1) < 1e-6 for n in reports["converted"]["norms"])
    table = format_comparison(reports["original"], reports["converted"])
    assert "orthogonal to 1 to floating-point noise" in table and "transformer.ln_f" in table
    assert "transformer.h.1.ln_2" in format_report(reports["original"])


# --- naive conversion: exact iff the residual is orthogonal to 1 -----------------------------------


def naive_conversion(model: GPT2LMHeadModel, tmp_path) -> dict:
    """``normswap convert --method naive --allow-inexact`` of ``model``; returns its verification figures."""
    model.save_pretrained(tmp_path / "src")
    provenance = normswap.convert_checkpoint(tmp_path / "src", tmp_path / "naive", method="naive", allow_inexact=True)
    return provenance["verification"]["loaders"]["remote_code"]


def test_naive_conversion_of_an_orthogonal_model_is_exact(tmp_path):
    model = centre_writers(tiny_gpt2(mean=0.7, dtype=torch.float32))
    figures = naive_conversion(model, tmp_path)
    assert figures["passed"] and figures["max_abs_diff"] < 1e-5 and figures["top1_agreement"] == 1.0
    # geometry predicts it: no mean at any norm, so no error at any norm
    assert max(n["naive_error"]["max"] for n in run_geometry(model, token_ids(), seq_len=32)) < 1e-6


def test_naive_conversion_of_a_non_orthogonal_model_is_measurably_inexact(tmp_path):
    model = tiny_gpt2(mean=0.7, dtype=torch.float32)
    figures = naive_conversion(model, tmp_path)
    assert not figures["passed"] and figures["max_abs_diff"] > 1e-2 and figures["mean_kl"] > 1e-4
    assert min(n["naive_error"]["mean"] for n in run_geometry(model, token_ids(), seq_len=32)) > 1e-2


def test_in_memory_naive_swap_matches_the_geometry_prediction():
    ids = token_ids()
    orthogonal = centre_writers(tiny_gpt2(mean=0.7))
    naive = normswap.convert_model(orthogonal, method="naive")
    assert (logits(orthogonal, ids) - logits(naive, ids)).abs().max().item() < 1e-12  # fp64 model: fp64 noise
    skewed = tiny_gpt2(mean=0.7)
    naive = normswap.convert_model(skewed, method="naive")
    assert (logits(skewed, ids) - logits(naive, ids)).abs().max().item() > 1e-2


# --- the command ---------------------------------------------------------------------------------


def geometry(argv: list[str]) -> int:
    """``normswap geometry ARGV`` without the dispatcher, so NormswapError propagates to the test."""
    parser = argparse.ArgumentParser()
    geometry_cli.configure(parser)
    return geometry_cli.run(parser.parse_args(argv))


def one_line_error(argv: list[str]) -> str:
    with pytest.raises(NormswapError) as caught:
        geometry(argv)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


def test_missing_text_file_is_a_one_line_error(tmp_path):
    assert "text file not found" in one_line_error([str(tmp_path), "--text", str(tmp_path / "absent.txt")])


def test_unknown_model_is_a_one_line_error(tmp_path):
    one_line_error([str(tmp_path / "no-such-model"), "--random-tokens"])
    one_line_error(["not a model id!", "--random-tokens"])


def test_report_is_json_serialisable():
    ids = token_ids()
    norms = run_geometry(tiny_gpt2(mean=0.2), ids, seq_len=32)
    report = build_report(norms, model="tiny", dtype=torch.float64, tokens=ids.numel(), text="random")
    decoded = json.loads(json.dumps(report))
    assert decoded["position"]["depth"]["all"]["all_layers"]["mean_share"]["spearman"] is not None
    assert decoded["dominant_dims"][0]["dim"] == MASSIVE_DIM


PROSE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
         "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
         "neighbourhood, this truth is so well fixed in the minds of the surrounding families. ")


def save_with_tokenizer(model: GPT2LMHeadModel, path) -> None:
    """Save ``model`` with a tiny BPE tokenizer trained on ``PROSE`` (vocabulary within the model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([PROSE], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>"]))
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(path)


@pytest.mark.slow
def test_command_compares_original_and_converted(tmp_path, capsys):
    save_with_tokenizer(tiny_gpt2(mean=0.7, dtype=torch.float32), tmp_path / "src")
    normswap.convert_checkpoint(tmp_path / "src", tmp_path / "rms")
    (tmp_path / "text.txt").write_text(PROSE * 3)
    argv = [str(tmp_path / "src"), "--compare", str(tmp_path / "rms"), "--text", str(tmp_path / "text.txt"),
            "--out", str(tmp_path / "geometry"), "--plot"]
    assert geometry(argv) == 0
    out = capsys.readouterr().out
    assert "transformer.h.1.ln_2" in out and "orthogonal to 1 to floating-point noise" in out
    report = json.loads((tmp_path / "geometry" / "report.json").read_text())
    assert report["original"]["tokens"] == report["converted"]["tokens"] > 32
    assert report["original"]["text"].endswith("text.txt")
    assert all(n["mean_share"] > 0.3 for n in report["original"]["norms"])
    assert all(n["abs_cos"]["max"] < 1e-6 for n in report["converted"]["norms"])
    assert (tmp_path / "geometry" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "transformer.h.1.ln_2" in (tmp_path / "geometry" / "report.md").read_text()


def test_model_without_tokenizer_needs_random_tokens(tmp_path, capsys):
    tiny_gpt2(mean=0.7, dtype=torch.float32).save_pretrained(tmp_path / "src")
    (tmp_path / "text.txt").write_text(PROSE)
    message = one_line_error([str(tmp_path / "src"), "--text", str(tmp_path / "text.txt")])
    assert "no tokenizer" in message and "--random-tokens" in message
    assert geometry([str(tmp_path / "src"), "--random-tokens", "--max-tokens", "64"]) == 0
    assert "random ids" in capsys.readouterr().out


def test_reports_are_written_whole(tmp_path, monkeypatch, capsys):
    """A failure while writing --out leaves neither a half-written folder nor the temporary one."""
    from normswap import cli
    from normswap.analysis import plot

    def fail(reports, path):
        path.write_text("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plot, "plot_reports", fail)
    out = tmp_path / "geometry"
    code = cli.main(["geometry", "normswap:austen-gpt2", "--max-tokens", "64", "--out", str(out), "--plot"])
    err = capsys.readouterr().err
    assert code == 2 and "no space left" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []
