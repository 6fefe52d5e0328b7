"""Fake quantisation against hand-computed values, and the outlier statistics of linear inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from normswap.analysis.outliers import _Moments, linear_input_outliers
from normswap.rotate.quantise import fake_quantise, linear_layers, quantise_model


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
