"""Where a native op beats a Triton launch: the crossover tables, measured on a GPU.

``FORWARD``: eager forwards at decode shapes, keyed by (M, N, dtype, fused), each entry
(native µs, Triton µs) of host wall time per call: native is ``F.rms_norm`` (after ``torch.add``
when fused), Triton normswap's kernel. ``BACKWARD``: backwards at M = 16384 keyed by (N, dtype),
(native ms, Triton ms): native is the backward autograd runs through ``F.rms_norm``.

Both are derived by ``derive`` from ``SOURCE``, the JSON of ``scripts/bench_kernels.py`` on an
H200 (torch 2.11, triton 3.6, 2026-11-30): its ``decode`` rows (bf16, M = 1, 8, 32, N = 768,
2048, 4096, plain and fused_add) and its ``backward`` rows (bf16, M = 16384, N = 768-65536). The
Triton figure of a cell is the ``normswap`` row's, or where the file predates that name the best
of its ``normswap_*`` designs (``normswap_unfused``, the add then the norm, and
``normswap_dispatched``, the call as this table dispatches it, are not designs).
Regenerate after a GPU run with::

    python -m normswap.kernels.ops.crossover benchmarks/results/gpu/bench_kernels-cuda.json

which prints both literals; ``tests/test_kernels_designs.py`` checks they match the source.

Lookups take the cell of the smallest measured M (N) at or above the call's, and say "Triton"
beyond the largest measured (large M is where the kernel wins); a dtype not measured borrows the
rows of a measured dtype of its element size (host time does not depend on which 16-bit type).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SOURCE = "benchmarks/results/gpu/bench_kernels-cuda.json"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SIZES = {"bf16": 2, "fp16": 2, "fp32": 4}

# (M, N, dtype, fused): (native µs, Triton µs), host wall time per eager call
FORWARD: dict[tuple[int, int, str, bool], tuple[float, float]] = {
    (1, 768, 'bf16', False): (18.225, 30.3679),
    (1, 768, 'bf16', True): (22.4725, 26.9346),
    (1, 2048, 'bf16', False): (16.9725, 31.1057),
    (1, 2048, 'bf16', True): (30.0906, 30.9544),
    (1, 4096, 'bf16', False): (17.051, 31.1814),
    (1, 4096, 'bf16', True): (27.849, 36.1543),
    (8, 768, 'bf16', False): (18.8488, 25.0392),
    (8, 768, 'bf16', True): (27.8172, 42.0831),
    (8, 2048, 'bf16', False): (18.239, 31.3907),
    (8, 2048, 'bf16', True): (29.0792, 24.7056),
    (8, 4096, 'bf16', False): (17.4752, 32.1818),
    (8, 4096, 'bf16', True): (30.3417, 37.8062),
    (32, 768, 'bf16', False): (17.9049, 31.3348),
    (32, 768, 'bf16', True): (28.9022, 36.8397),
    (32, 2048, 'bf16', False): (19.5174, 32.3789),
    (32, 2048, 'bf16', True): (29.401, 37.9963),
    (32, 4096, 'bf16', False): (16.7798, 31.9893),
    (32, 4096, 'bf16', True): (29.2176, 39.9767),
}
# (N, dtype): (native ms, Triton ms), backward of x and the weight at M = 16384
BACKWARD: dict[tuple[int, str], tuple[float, float]] = {
    (768, 'bf16'): (0.1262, 0.4402),
    (2048, 'bf16'): (0.1364, 0.2888),
    (4096, 'bf16'): (0.2296, 0.48),
    (8192, 'bf16'): (0.5149, 0.5196),
    (16384, 'bf16'): (1.0485, 0.8994),
    (65536, 'bf16'): (4.3235, 4.1156),
}


def derive(rows: list[dict]) -> tuple[dict, dict]:
    """(FORWARD, BACKWARD) from a bench_kernels JSON's result rows."""
    cells: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.get("section") == "decode" and "wall_us" in row:
            key, value = (row["M"], row["N"], row["dtype"], row["variant"] == "fused_add"), row["wall_us"]
        elif row.get("section") == "backward" and "ms_median" in row:
            key, value = (row["N"], row["dtype"]), row["ms_median"]
        else:
            continue
        cells.setdefault(key, {})[row["impl"]] = value
    forward, backward = {}, {}
    for key, impls in cells.items():
        designs = [v for name, v in impls.items()
                   if name.startswith("normswap_") and name not in ("normswap_unfused", "normswap_dispatched")]  # fmt: skip
        triton = impls.get("normswap", min(designs, default=None))
        if triton is None or "F.rms_norm" not in impls:
            continue
        (forward if len(key) == 4 else backward)[key] = (round(impls["F.rms_norm"], 4), round(triton, 4))
    return dict(sorted(forward.items())), dict(sorted(backward.items()))


def _measured_dtype(dtype: torch.dtype, dtypes: set[str]) -> str | None:
    name = DTYPE_NAMES.get(dtype)
    if name in dtypes:
        return name
    return next((d for d in sorted(dtypes) if _SIZES[d] == _SIZES.get(name)), None)


def _at_or_above(value: int, measured: set[int]) -> int | None:
    return min((v for v in measured if v >= value), default=None)


def native_forward_faster(m: int, n: int, dtype: torch.dtype, fused: bool, table: dict | None = None) -> bool:
    """Whether the native ops were measured faster than a Triton launch for an eager forward of
    (m, n) rows of ``dtype`` (with the residual add when ``fused``)."""
    table = FORWARD if table is None else table
    name = _measured_dtype(dtype, {k[2] for k in table})
    cells = {(k[0], k[1]): v for k, v in table.items() if k[2] == name and k[3] == fused}
    m_at = _at_or_above(m, {k[0] for k in cells})
    n_at = _at_or_above(n, {k[1] for k in cells})
    cell = cells.get((m_at, n_at))
    return cell is not None and cell[0] < cell[1]


def native_backward_faster(n: int, dtype: torch.dtype, table: dict | None = None) -> bool:
    """Whether autograd's backward through ``F.rms_norm`` was measured faster than normswap's
    for rows of ``n`` elements of ``dtype``."""
    table = BACKWARD if table is None else table
    name = _measured_dtype(dtype, {k[1] for k in table})
    cells = {k[0]: v for k, v in table.items() if k[1] == name}
    cell = cells.get(_at_or_above(n, set(cells)))
    return cell is not None and cell[0] < cell[1]


def main(argv: list[str]) -> int:
    """Print the FORWARD and BACKWARD literals derived from a bench_kernels JSON."""
    path = Path(argv[0] if argv else SOURCE)
    forward, backward = derive(json.loads(path.read_text())["results"])
    for name, table in (("FORWARD", forward), ("BACKWARD", backward)):
        print(f"{name} = {{")
        for key, value in table.items():
            print(f"    {key!r}: {value!r},")
        print("}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
