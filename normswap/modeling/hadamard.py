"""Hadamard matrices of order d: H with entries ±1 and H·Hᵀ = d·I.

Constructions, combined recursively:

* Sylvester: H_2 = [[1, 1], [1, -1]], and H_a ⊗ H_b is a Hadamard matrix of order a·b whenever
  H_a and H_b are (so every power of two, and every product of known orders);
* Paley I, for a prime p ≡ 3 (mod 4), order p + 1: with χ the quadratic character mod p and the
  Jacobsthal matrix J_ij = χ(j - i) (antisymmetric), S = [[0, 1ᵀ], [-1, J]] and H = I + S;
* Paley II, for a prime p ≡ 1 (mod 4), order 2(p + 1): with C = [[0, 1ᵀ], [1, J]] (symmetric),
  H replaces each 0 of C by [[1, -1], [-1, -1]] and each ±1 by ±[[1, 1], [1, -1]].

Paley gives the small orders 12, 20, 28, 36, 44, 60, 68, 84, 108, 140, ..., and Kronecker
products with powers of two reach the hidden sizes of common models (768 = 12·64,
1280 = 20·64, 1600 = 20·20·4, 2560 = 20·128, 4544 = 284·16). Orders that need Paley over a
prime-power field (52 = 2·(25 + 1)) or other constructions (Williamson's 156, 172) are not
built; ``hadamard_matrix`` says so.
"""

from __future__ import annotations

import functools

import torch


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    factor = 3
    while factor * factor <= n:
        if n % factor == 0:
            return False
        factor += 2
    return True


def _jacobsthal(p: int) -> torch.Tensor:
    """J_ij = χ(j - i) mod p: 1 for a non-zero square, -1 for a non-square, 0 on the diagonal."""
    squares = {(k * k) % p for k in range(1, p)}
    character = torch.tensor([0] + [1 if k in squares else -1 for k in range(1, p)], dtype=torch.int8)
    index = torch.arange(p)
    return character[(index[None, :] - index[:, None]) % p]


def _bordered(p: int, first_column: int) -> torch.Tensor:
    """[[0, 1ᵀ], [c·1, J]] of order p + 1."""
    core = torch.zeros(p + 1, p + 1, dtype=torch.int8)
    core[0, 1:] = 1
    core[1:, 0] = first_column
    core[1:, 1:] = _jacobsthal(p)
    return core


def paley_one(p: int) -> torch.Tensor:
    """Paley's first construction, order p + 1 (p prime, p ≡ 3 mod 4)."""
    return torch.eye(p + 1, dtype=torch.int8) + _bordered(p, -1)


def paley_two(p: int) -> torch.Tensor:
    """Paley's second construction, order 2(p + 1) (p prime, p ≡ 1 mod 4)."""
    core = _bordered(p, 1)
    zero_block = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int8)
    sign_block = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
    return torch.kron(core, sign_block) + torch.kron((core == 0).to(torch.int8), zero_block)


def _base(n: int) -> tuple[str, int] | None:
    """A direct construction of order n: ("sylvester", 2), ("paley1", p) or ("paley2", p)."""
    if n in (1, 2):
        return ("sylvester", n)
    if n % 4:
        return None
    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return ("paley1", n - 1)
    if _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        return ("paley2", n // 2 - 1)
    return None


@functools.cache
def construction(n: int) -> tuple[tuple[str, int], ...] | None:
    """Kronecker factors (kind, parameter) whose product builds order n, or None if none is known.

    Powers of two are taken out first (Sylvester), then a direct construction of what remains
    is tried, then a split of it into two constructible orders.
    """
    if n < 1:
        return None
    if n == 1:
        return ()
    if n % 2 == 0 and (n // 2) % 2 == 0 or n == 2:
        # take out a factor of two while what remains stays constructible
        rest = construction(n // 2)
        if rest is not None:
            return (("sylvester", 2), *rest)
    base = _base(n)
    if base is not None:
        return (base,)
    for a in range(4, int(n**0.5) + 1, 4):
        if n % a == 0 and n // a % 4 == 0:
            left, right = construction(a), construction(n // a)
            if left is not None and right is not None:
                return (*left, *right)
    return None


def describe(n: int) -> str | None:
    """The construction of order n in words (``sylvester 2^6 ⊗ paley1 11``), or None."""
    factors = construction(n)
    if factors is None:
        return None
    twos = sum(1 for kind, _ in factors if kind == "sylvester")
    parts = [f"sylvester 2^{twos}"] if twos else []
    parts += [f"{kind} p={p}" for kind, p in factors if kind != "sylvester"]
    return " ⊗ ".join(parts) or "1"


def _known(n: int) -> tuple[tuple[str, int], ...]:
    factors = construction(n)
    if factors is None:
        raise ValueError(
            f"no Hadamard construction is known here for order {n} (Sylvester, prime Paley I/II and "
            "their Kronecker products cover it not)"
        )
    return factors


def hadamard_matrix(n: int) -> torch.Tensor:
    """A Hadamard matrix of order n (int8 entries ±1), or ValueError when no construction is known."""
    return _product(_known(n))


def kronecker_split(n: int) -> tuple[int, torch.Tensor]:
    """(k, F) with ``hadamard_matrix(n)`` = H₂^⊗k ⊗ F: the leading Sylvester factors, and F (int8,
    order n / 2^k) the Kronecker product of the others. x·H is then k butterflies and one product
    with F (``normswap.modeling.remote.hadamard_transform``), O(n·(k + n/2^k)) for one vector."""
    factors = _known(n)
    twos = next((index for index, (kind, _) in enumerate(factors) if kind != "sylvester"), len(factors))
    return twos, _product(factors[twos:])


def _product(factors: tuple[tuple[str, int], ...]) -> torch.Tensor:
    """The Kronecker product of the factors, in order (int8)."""
    matrix = torch.ones(1, 1, dtype=torch.int8)
    for kind, parameter in factors:
        if kind == "sylvester":
            factor = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
        elif kind == "paley1":
            factor = paley_one(parameter)
        else:
            factor = paley_two(parameter)
        matrix = torch.kron(matrix, factor.to(torch.int8))
    return matrix
