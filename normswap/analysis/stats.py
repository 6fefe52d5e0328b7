"""Pure float64 statistics of hidden vectors relative to the all-ones direction.

Notation: ``x`` is a batch of hidden vectors of shape ``[N, d]`` (N tokens, d hidden dims),
``1`` is the all-ones vector of length d, and for one token

    μ = mean_i x_i = <x, 1> / d,        ‖x‖ = sqrt(Σ_i x_i²),
    RMS(x) = ‖x‖ / √d,                  std(x) = sqrt(mean_i (x_i - μ)²)   (population, as LayerNorm).

Since ‖1‖ = √d, the projection of x on the unit vector 1/√d is μ√d, which gives the identities

    cos θ = <x, 1> / (‖x‖ ‖1‖) = μ √d / ‖x‖,
    share = |μ| √d / ‖x‖ = |cos θ|           (fraction of ‖x‖ that lies along 1),
    RMS(x)² = std(x)² + μ²   ⇒   RMS / std = 1 / sqrt(1 - cos² θ) = 1 / |sin θ|.

So every per-token quantity here is a function of cos θ; they are reported separately because their
averages over tokens answer different questions (how much of the vector is along 1; how far the
RMSNorm scale is from the LayerNorm scale; what a naive swap does to the norm's output).

All functions take any float tensor and compute in float64; none has side effects.
"""

from __future__ import annotations

import math

import torch

PERCENTILES: tuple[int, ...] = (5, 50, 95)


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # A zero vector has no direction: report 0 along 1 rather than nan.
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def cos_to_ones(x: torch.Tensor) -> torch.Tensor:
    """cos θ between each row of ``x`` and 1: μ√d / ‖x‖ (0 for a zero row). Shape ``[N]``."""
    x = _f64(x)
    d = x.shape[-1]
    return _safe_div(x.mean(-1) * math.sqrt(d), x.norm(dim=-1))


def mean_share(x: torch.Tensor) -> torch.Tensor:
    """Share of each row's norm along 1: |μ|√d / ‖x‖, which equals |cos θ|. Shape ``[N]``."""
    return cos_to_ones(x).abs()


def pooled_mean_share(x: torch.Tensor) -> float:
    """Share of the whole batch's norm along 1: sqrt(Σ_t d μ_t² / Σ_t ‖x_t‖²).

    Unlike the mean of per-token shares, this weights each token by its norm, so a few tokens with
    large norms (e.g. the first position of GPT-2, which carries massive activations) count more.
    """
    x = _f64(x)
    d = x.shape[-1]
    along = (x.mean(-1).pow(2) * d).sum()
    total = x.pow(2).sum()
    return float(torch.sqrt(along / total)) if total > 0 else 0.0


def isotropic_mean_abs_cos(d: int) -> float:
    """E|cos θ| between a fixed direction and a random isotropic vector in d dims: the yardstick.

        E|cos θ| = Γ(d/2) / (√π Γ((d+1)/2)) ≈ sqrt(2 / (π d))   (2/π for d = 2).

    A model that neither seeks nor avoids the direction of 1 would show about this much.
    """
    return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


def rms_std_ratio(x: torch.Tensor) -> torch.Tensor:
    """RMS(x) / std(x) per row, = 1/|sin θ| ≥ 1 (inf when x is a nonzero multiple of 1)."""
    x = _f64(x)
    rms = x.pow(2).mean(-1).sqrt()
    std = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1).sqrt()
    ratio = _safe_div(rms, std)
    # std = 0: a constant row c·1 has ratio inf (c ≠ 0); the zero row is taken as 1 (no distortion).
    degenerate = torch.where(rms > 0, torch.full_like(rms, math.inf), torch.ones_like(rms))
    return torch.where(std > 0, ratio, degenerate)


def _affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LN(x) = (x - μ) / sqrt(var(x) + eps) · γ + β over the last dimension, in float64."""
    x = _f64(x)
    centred = x - x.mean(-1, keepdim=True)
    return _affine(centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps), weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm(x) = x / sqrt(mean(x²) + eps) · γ + β over the last dimension, in float64."""
    x = _f64(x)
    return _affine(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), weight, bias)


def naive_swap_error(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     eps: float = 1e-5) -> torch.Tensor:
    """Relative output error of replacing LayerNorm by RMSNorm with the same γ, β, eps, per row:

        ‖LN(x) - RMSNorm(x)‖ / ‖LN(x)‖.

    β cancels in the difference but stays in the denominator, so this is the error relative to what
    the next layer actually reads. It is exactly 0 when μ = 0 (eps included), which is why the
    exact conversion centres the residual stream first.
    """
    reference = layer_norm(x, weight, bias, eps)
    difference = reference - rms_norm(x, weight, bias, eps)
    return _safe_div(difference.norm(dim=-1), reference.norm(dim=-1))


class MeanDimAccumulator:
    """Which hidden dimensions the mean μ comes from, accumulated over batches of tokens.

    E[μ²] = E[μ · (1/d) Σ_i x_i] = Σ_i E[x_i μ] / d, so dimension i's share of the mean's energy is

        c_i = E_t[x_{t,i} μ_t] / (d · E_t[μ_t²]),     with Σ_i c_i = 1 exactly.

    A dimension with c_i near 1 carries the mean on its own (a massive-activation dimension); a
    negative c_i works against the mean. ``mean_x`` (E_t[x_{t,i}]) is kept for display.
    """

    def __init__(self, d: int) -> None:
        self.d = d
        self.tokens = 0
        self.x_mu = torch.zeros(d, dtype=torch.float64)
        self.mu_sq = 0.0
        self.x_sum = torch.zeros(d, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        x = _f64(x).reshape(-1, self.d)
        mu = x.mean(-1)
        # Sums are reduced where x lives (maybe a GPU) and kept on the CPU.
        self.x_mu += (x * mu[:, None]).sum(0).cpu()
        self.mu_sq += float(mu.pow(2).sum())
        self.x_sum += x.sum(0).cpu()
        self.tokens += x.shape[0]

    def contributions(self) -> torch.Tensor:
        """c_i for every dimension (zeros when μ was identically 0)."""
        if self.mu_sq <= 0:
            return torch.zeros(self.d, dtype=torch.float64)
        return self.x_mu / (self.d * self.mu_sq)

    def top(self, k: int = 5) -> list[dict[str, float]]:
        """The k dimensions with the largest |c_i|, with c_i and E[x_i]."""
        c = self.contributions()
        mean_x = self.x_sum / max(self.tokens, 1)
        order = torch.argsort(c.abs(), descending=True)[:k]
        return [{"dim": int(i), "share_of_mean": float(c[i]), "mean_x": float(mean_x[i])} for i in order]


def summarise(values: torch.Tensor, percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """Mean, max and the given percentiles (linear interpolation) of the finite values of a tensor.

    Non-finite values (RMS/std of a constant row is inf) are left out rather than poisoning the mean.
    """
    v = _f64(values).flatten()
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return {"mean": math.nan, "max": math.nan, **{f"p{p}": math.nan for p in percentiles}}
    q = torch.quantile(v, torch.tensor([p / 100 for p in percentiles], dtype=torch.float64))
    return {"mean": float(v.mean()), "max": float(v.max()), **{f"p{p}": float(val) for p, val in zip(percentiles, q, strict=True)}}


def pearson(a: list[float], b: list[float]) -> float:
    """Pearson correlation r = cov(a, b) / (σ_a σ_b); nan with fewer than 3 points or no variance."""
    x = torch.tensor(a, dtype=torch.float64)
    y = torch.tensor(b, dtype=torch.float64)
    if x.numel() < 3:
        return math.nan
    x, y = x - x.mean(), y - y.mean()
    den = float(x.norm() * y.norm())
    return float((x * y).sum()) / den if den > 0 else math.nan


def _ranks(values: list[float]) -> list[float]:
    # Average ranks, so ties do not bias Spearman's coefficient.
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation: Pearson's r on the (average) ranks of a and b."""
    return pearson(_ranks(a), _ranks(b))


def slope(a: list[float], b: list[float]) -> float:
    """Least-squares slope of b on a: cov(a, b) / var(a); nan with fewer than 2 points."""
    x = torch.tensor(a, dtype=torch.float64)
    y = torch.tensor(b, dtype=torch.float64)
    if x.numel() < 2:
        return math.nan
    x = x - x.mean()
    den = float(x.pow(2).sum())
    return float((x * (y - y.mean())).sum()) / den if den > 0 else math.nan
