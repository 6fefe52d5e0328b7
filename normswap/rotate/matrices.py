"""Rotation matrices Q: how each is made, recorded and stored beside a rotated checkpoint.

Q is ``hadamard`` (diag(±1)·H/√d, H from ``normswap.modeling.hadamard``), ``orthogonal`` (seeded Haar),
or ``pca`` (the principal directions of the stream on calibration text, ``normswap.rotate.calibration``).
Q is saved beside the weights (``normswap_rotation.record``, through the ``safetensors``
package: one small tensor) so that the checkpoint can be verified, its activations mapped back
(x = x'·Qᵀ), or the rotation undone. How a rotated tensor is computed from Q is
``normswap.convert.fold.rotate_axis``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.checkpoint.provenance import ROTATION_FILE
from normswap.checkpoint.source import read_config
from normswap.errors import NormswapError, quoted
from normswap.modeling import hadamard


@dataclass(frozen=True, eq=False)
class Rotation:
    """An orthogonal d×d matrix (float64) and how it was made."""

    method: str
    seed: int | None
    matrix: torch.Tensor
    construction: str
    calibration: dict | None = None

    @property
    def dimension(self) -> int:
        return self.matrix.shape[0]

    @property
    def sha256(self) -> str:
        """Hash of Q's float64 little-endian bytes, row-major."""
        return hashlib.sha256(self.matrix.contiguous().numpy().tobytes()).hexdigest()

    def provenance(self) -> dict:
        block = {"method": self.method, "seed": self.seed, "dimension": self.dimension,
                 "construction": self.construction, "matrix_sha256": self.sha256, "matrix_file": ROTATION_FILE}
        if self.calibration is not None:
            block["calibration"] = self.calibration
        return block


def random_signs(d: int, seed: int) -> torch.Tensor:
    """d signs ±1 (float64) drawn from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=generator).double() * 2 - 1


def randomised_hadamard(hadamard: torch.Tensor, seed: int) -> torch.Tensor:
    """Q = diag(s)·H/√d for a Hadamard matrix H (entries ±1, HHᵀ = d·I) and seeded signs s.

    QQᵀ = diag(s)·HHᵀ·diag(s)/d = I. Every entry of Q is ±1/√d, so each coordinate of the rotated
    stream x·Q is an equal-weight mix of all of x's, which spreads a few large coordinates evenly.
    This is the issue's H·diag(±1)/√d written for row vectors: the signs act on x before H mixes
    it (x·diag(s)·H). Signs applied after H (x·H·diag(s)) would only flip coordinates of x·H,
    which no symmetric quantiser or outlier statistic can see: every seed would give the same
    model up to signs.
    """
    d = hadamard.shape[0]
    return random_signs(d, seed)[:, None] * hadamard.double() / math.sqrt(d)


def random_orthogonal(d: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal d×d matrix: QR of a seeded Gaussian matrix, with the sign fix.

    For G = QR, Q·diag(sign(diag R)) is distributed uniformly over O(d) (without the fix the
    distribution depends on the QR routine's sign convention).
    """
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(d, d, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs


def principal_rotation(second_moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q whose columns are the eigenvectors of M = Σ xᵀx, by decreasing eigenvalue; and those.

    x·Q then has its coordinates sorted by how much of the stream's energy they carry (the
    first column is the stream's principal direction). Each column's sign is fixed so that its
    largest-magnitude entry is positive, making Q a function of M alone.
    """
    values, vectors = torch.linalg.eigh(second_moment.double())
    order = torch.argsort(values, descending=True, stable=True)
    values, vectors = values[order], vectors[:, order]
    largest = vectors.abs().argmax(dim=0)
    signs = torch.sign(vectors[largest, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return vectors * signs, values


def constructible_hadamard(d: int) -> tuple[torch.Tensor, str]:
    """A Hadamard matrix of order ``d`` and how it is constructed; a one-line error when none is."""
    construction = hadamard.describe(d)
    if construction is None:
        raise NormswapError(
            f"no Hadamard matrix of order {d} is constructible here (Sylvester, prime-order Paley and their "
            "Kronecker products); use --method orthogonal"
        )
    return hadamard.hadamard_matrix(d), construction


def hadamard_rotation(d: int, seed: int) -> Rotation:
    """Q = diag(s)·H/√d with a Hadamard H of order d and seeded signs s (``randomised_hadamard``)."""
    h, construction = constructible_hadamard(d)
    return Rotation("hadamard", seed, randomised_hadamard(h, seed), f"diag(±1)·H/√d, H = {construction}")


def orthogonal_rotation(d: int, seed: int) -> Rotation:
    return Rotation("orthogonal", seed, random_orthogonal(d, seed), "QR of a seeded Gaussian, sign-fixed")


def pca_rotation(second_moment: torch.Tensor, calibration: dict) -> Rotation:
    matrix, values = principal_rotation(second_moment)
    total = float(values.clamp(min=0).sum())
    share = values.clamp(min=0).cumsum(0) / total if total > 0 else values
    kept = {f"top_{k}": float(share[k - 1]) for k in (1, 8, 32) if k <= values.numel()}
    return Rotation("pca", None, matrix, "eigenvectors of Σ xᵀx over the calibration stream, by decreasing variance",
                    {**calibration, "energy_share": kept})


def save_rotation(path: Path, rotation: Rotation) -> None:
    from safetensors.torch import save_file

    # no metadata: safetensors writes a metadata map in no fixed order, and the file must be
    # byte-identical across rebuilds (config.json records the method and the hash)
    save_file({"rotation": rotation.matrix.contiguous()}, str(path))
    path.chmod(0o644)  # as the weights: readable like the rest of the checkpoint


def rotation_block(checkpoint: Path, config: dict) -> dict:
    """The ``normswap.rotation`` block of a rotated checkpoint's ``config``, refused in one line
    unless it is a mapping with the hash of the stored Q."""
    block = config.get("normswap", {}).get("rotation")
    if block is None:
        raise NormswapError(f"{checkpoint} is not a rotated normswap checkpoint")
    if not isinstance(block, dict) or not isinstance(block.get("matrix_sha256"), str):
        raise NormswapError(f"{checkpoint}/config.json: normswap.rotation must be a mapping with a matrix_sha256")
    return block


def load_rotation(checkpoint: Path, dimension: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Q of a rotated checkpoint, checked before use: a float64 ``dimension``-square matrix,
    orthogonal (|QᵀQ - I| < 1e-9), whose hash is the one its provenance records (``config``: its
    config.json, when the caller has read it)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    block = rotation_block(checkpoint, read_config(checkpoint) if config is None else config)
    file = checkpoint / ROTATION_FILE
    if not file.is_file():
        raise NormswapError(f"{checkpoint} lacks {ROTATION_FILE}, the rotation it was made with")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as error:
        raise NormswapError(f"{file} is not a readable safetensors file ({error})") from None
    matrix = tensors.get("rotation")
    if matrix is None or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or not matrix.is_floating_point():
        raise NormswapError(f"{file} must hold one square floating tensor named 'rotation'")
    matrix = matrix.double()
    if dimension is not None and matrix.shape[0] != dimension:
        raise NormswapError(f"{file} is {matrix.shape[0]}x{matrix.shape[0]}, but the model's stream has {dimension} dimensions")
    if matrix.shape[0] != block.get("dimension"):
        raise NormswapError(f"{file} is {matrix.shape[0]}x{matrix.shape[0]}, but config.json records a rotation of "
                            f"dimension {quoted(block.get('dimension'), 30)}")
    if hashlib.sha256(matrix.contiguous().numpy().tobytes()).hexdigest() != block["matrix_sha256"]:
        raise NormswapError(f"{file} does not match the rotation hash recorded in config.json")
    error = float((matrix.T @ matrix - torch.eye(matrix.shape[0], dtype=torch.float64)).abs().max())
    if not error < 1e-9:
        raise NormswapError(f"{file} is not orthogonal (max |QᵀQ - I| = {error:.3g}); it is not a rotation")
    return matrix
