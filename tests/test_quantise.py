"""Fake quantisation against hand-computed values, and the outlier statistics of linear inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from normswap.analysis.outliers import _Moments, linear_input_outliers
from normswap.modeling.online import is_down_projection
from normswap.rotate.quantise import (
    QUANTISERS,
    apply_quantiser,
    fake_quantise,
    fake_quantise_tokens,
    linear_layers,
    quantise_model,
)


def test_int4_per_channel_by_hand():
    # q_max = 7; row 0: s = 1/7, w/s = [7, -4.2, 1.75, 0] rounds to [7, -4, 2, 0]
    w = torch.tensor([[1.0, -0.6, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[1.0, -4 / 7, 2 / 7, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(fake_quantise(w, 4, input_axis=1), expected, atol=1e-7)
    # the same weight stored [in, out] (Conv1D) quantises per column
    assert torch.allclose(fake_quantise(w.T.contiguous(), 4, input_axis=0), expected.T, atol=1e-7)


def test_int8_by_hand():
    # q_max = 127, s = 1/127: 0.3·127 = 38.1 → 38
    w = torch.tensor([[0.3, -1.0]])
    assert torch.allclose(fake_quantise(w, 8, input_axis=1), torch.tensor([[38 / 127, -1.0]]), atol=1e-7)


def test_groups_by_hand():
    # groups [1, 0.1] (s = 1/7: 7, 0.7 → 1) and [0.25, 0.4] (s = 0.4/7: 4.375 → 4, 7)
    w = torch.tensor([[1.0, 0.1, 0.25, 0.4]])
    expected = torch.tensor([[1.0, 1 / 7, 0.4 * 4 / 7, 0.4]])
    assert torch.allclose(fake_quantise(w, 4, input_axis=1, group_size=2), expected, atol=1e-7)
    with pytest.raises(ValueError, match="does not divide"):
        fake_quantise(w, 4, input_axis=1, group_size=3)
    with pytest.raises(ValueError, match="bits"):
        fake_quantise(w, 1, input_axis=1)


def test_quantise_model_touches_only_the_chosen_linear_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    before = [module.weight.clone() for module in (model[0], model[1][0])]
    assert quantise_model(model, 4, within="1") == 1
    assert torch.equal(model[0].weight, before[0])
    levels = model[1][0].weight / (model[1][0].weight.abs().amax(1, keepdim=True) / 7)
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert [name for name, _, _ in linear_layers(model)] == ["0", "1.0"]


def test_moments_by_hand():
    moments = _Moments()
    moments.update(torch.tensor([1.0, -1.0, 1.0, -1.0]))
    moments.update(torch.tensor([3.0, -3.0]))
    summary = moments.summary()
    rms = math.sqrt((4 + 18) / 6)
    assert summary["outlier_ratio"] == pytest.approx(3 / rms)
    # mean 0, σ² = 22/6, E[x⁴] = (4 + 162)/6
    assert summary["kurtosis"] == pytest.approx((166 / 6) / (22 / 6) ** 2)


def test_linear_input_outliers_sees_every_layer():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)

        def forward(self, input_ids, use_cache=False):
            return self.proj(self.embed(input_ids))

    rows = linear_input_outliers(Tiny(), torch.arange(10), seq_len=5)
    assert [row["layer"] for row in rows] == ["proj"] and rows[0]["entries"] == 40


def test_activations_per_token_by_hand():
    # token 0: s = 2/127, 0.5·127/2 = 31.75 → 32; token 1 of zeros stays zero
    x = torch.tensor([[[2.0, 0.5], [0.0, 0.0]]])
    expected = torch.tensor([[[2.0, 32 * 2 / 127], [0.0, 0.0]]])
    assert torch.allclose(fake_quantise_tokens(x, 8), expected, atol=1e-7)


def test_w4a8_quantises_weights_and_every_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    seen = []
    assert set(QUANTISERS) == {"int8", "int4", "int4-g128", "W8A8", "W4A8"}
    assert apply_quantiser(model, "W4A8") == 2
    model[1].register_forward_pre_hook(lambda module, args: seen.append(args[0]))  # after the quantiser's hook
    model(x)
    levels = seen[0] / (seen[0].abs().amax(-1, keepdim=True) / 127)  # the input was quantised per token
    assert torch.allclose(levels, levels.round(), atol=1e-3)


def test_down_projections_are_the_mlps_not_the_attentions():
    assert is_down_projection("transformer.h.0.mlp.c_proj") and not is_down_projection("transformer.h.0.attn.c_proj")
    assert is_down_projection("model.decoder.layers.1.fc2") and is_down_projection("gpt_neox.layers.0.mlp.dense_4h_to_h")


def test_convert_fold_gains_warns_of_the_folding_trap(tmp_path, capsys):
    import transformers

    from normswap.cli import main

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "folded"), "--fold-gains",
                 "--verify", "none"]) == 0
    err = capsys.readouterr().err
    assert "warning: folding each γ" in err and "int4" in err and "normswap rotate" in err
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "plain"), "--verify", "none"]) == 0
    assert "folding" not in capsys.readouterr().err
