"""Rotations that commute with LayerNorm itself: orthogonal Q with Q·1 = 1.

With C = I - 11ᵀ/d, an orthogonal Q commutes with C exactly when Q·1 = 1: then Qᵀ·1 = QᵀQ·1 = 1
too, so C·Q = Q - 1(Qᵀ1)ᵀ/d = Q - 11ᵀ/d = Q - (Q1)1ᵀ/d = Q·C. For a row vector x and a weightless LayerNorm:

    LN(x·Q) = (x·Q)·C / sqrt(|x·Q·C|²/d + eps) = (x·C)·Q / sqrt(|x·C|²/d + eps) = LN(x)·Q

for every x, centred or not, eps included (|v·Q| = |v|). So once every norm's γ and β are folded
into the layers that read it, rotating every writer by Q and every reader by Qᵀ leaves the
function unchanged with the stock LayerNorm modules in place (weight 1, bias 0): no writer is
centred and nothing is centred at run time.

Constructions (U is any orthogonal matrix whose first column is 1/√d; ``complement_basis``):

* ``hadamard``: Q = H·diag(s)·Hᵀ/d, H a Hadamard matrix normalised so that its first column is
  all ones (rows multiplied by ±1: D·H is Hadamard for any signs D), s seeded signs with s₁ = +1.
  Hᵀ·1 = d·e₁ (the columns of H are orthogonal to its first), so Q·1 = H·s₁e₁ = 1, and
  QQᵀ = H·diag(s)·HᵀH·diag(s)·Hᵀ/d² = I. Q is symmetric; on the complement of 1 it is a
  randomised Hadamard transform (every entry of H·diag(s)·Hᵀ is a signed sum of d signs);
* ``orthogonal``: Q = U·diag(1, R)·Uᵀ, R a seeded Haar-random orthogonal (d-1)×(d-1) matrix:
  Haar-random among the orthogonal matrices that fix 1;
* ``pca``: Q = U·diag(1, V)·Uᵀ, V the eigenvectors (by decreasing eigenvalue, sign-fixed) of the
  stream's second moment restricted to the complement of 1, M' = (Uᵀ·M·U)[1:, 1:]. The
  coordinates of x·Q·U are then the mean direction followed by the principal directions of the
  centred stream; x·Q itself differs from them by the reflection U (a rank-one change).
"""

from __future__ import annotations

import math

import torch

from normswap.rotate import matrices
from normswap.rotate.matrices import Rotation


def normalised_hadamard(matrix: torch.Tensor) -> torch.Tensor:
    """D·H with D = diag(H[:, 0]): a Hadamard matrix whose first column is all ones (float64)."""
    matrix = matrix.double()
    return matrix * matrix[:, :1]


def complement_basis(d: int) -> torch.Tensor:
    """U = I - 2wwᵀ, the Householder reflection with U·e₁ = 1/√d: orthogonal, symmetric, and its
    first column is 1/√d, so its other columns span the complement of 1."""
    unit = torch.full((d,), 1 / math.sqrt(d), dtype=torch.float64)
    w = unit.clone()
    w[0] -= 1.0
    length = float(w.norm())
    eye = torch.eye(d, dtype=torch.float64)
    if length < 1e-12:  # d = 1: U = I already has the column
        return eye
    w /= length
    return eye - 2 * torch.outer(w, w)


def fixing_one(inner: torch.Tensor) -> torch.Tensor:
    """U·diag(1, R)·Uᵀ for an orthogonal (d-1)×(d-1) R: orthogonal, and it maps 1 to 1."""
    d = inner.shape[0] + 1
    basis = complement_basis(d)
    block = torch.eye(d, dtype=torch.float64)
    block[1:, 1:] = inner.double()
    return basis @ block @ basis.T


def hadamard_rotation(d: int, seed: int) -> Rotation:
    """Q = H·diag(s)·Hᵀ/d with H's first column all ones and seeded signs s, s₁ = +1."""
    h, construction = matrices.constructible_hadamard(d)
    h = normalised_hadamard(h)
    signs = matrices.random_signs(d, seed)
    signs[0] = 1.0
    matrix = (h * signs) @ h.T / d
    return Rotation("hadamard", seed, matrix, f"H·diag(s)·Hᵀ/d, s₁ = +1, H = {construction} with rows signed "
                    "so that its first column is 1 (Q·1 = 1)")


def orthogonal_rotation(d: int, seed: int) -> Rotation:
    """Q = U·diag(1, R)·Uᵀ with R Haar-random of order d - 1 (seeded)."""
    inner = matrices.random_orthogonal(d - 1, seed) if d > 1 else torch.ones(0, 0, dtype=torch.float64)
    return Rotation("orthogonal", seed, fixing_one(inner),
                    "U·diag(1, R)·Uᵀ, R = QR of a seeded Gaussian of order d-1, sign-fixed; U·e₁ = 1/√d (Q·1 = 1)")


def pca_rotation(second_moment: torch.Tensor, calibration: dict) -> Rotation:
    """Q = U·diag(1, V)·Uᵀ, V the principal directions of the stream within the complement of 1."""
    d = second_moment.shape[0]
    basis = complement_basis(d)
    within = (basis.T @ second_moment.double() @ basis)[1:, 1:]
    vectors, values = matrices.principal_rotation((within + within.T) / 2)
    total = float(values.clamp(min=0).sum())
    share = values.clamp(min=0).cumsum(0) / total if total > 0 else values
    kept = {f"top_{k}": float(share[k - 1]) for k in (1, 8, 32) if k <= values.numel()}
    return Rotation("pca", None, fixing_one(vectors),
                    "U·diag(1, V)·Uᵀ, V the eigenvectors of the calibration stream's Σ xᵀx within the complement "
                    "of 1, by decreasing variance (Q·1 = 1)", {**calibration, "energy_share": kept})


def commutes_with_centring(matrix: torch.Tensor, tolerance: float = 1e-9) -> bool:
    """Whether Q·1 = 1 and 1ᵀ·Q = 1ᵀ (to ``tolerance``): then LN(x·Q) = LN(x)·Q for a weightless LN."""
    ones = torch.ones(matrix.shape[0], dtype=torch.float64)
    matrix = matrix.double()
    return bool((matrix @ ones - ones).abs().max() < tolerance and (ones @ matrix - ones).abs().max() < tolerance)
