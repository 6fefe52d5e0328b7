"""Pure-torch RMSNorm used where the Triton kernels cannot run (CPU, no triton).

Math and rounding points are those of ``normswap.modeling.remote.RMSNorm.forward``::

    s = round_dtype(x + residual)                 # only with a residual: the unfused add
    r = rsqrt(mean(float32(s)**2) + eps)          # float32 statistics
    y = round_dtype(float32(s) * r * w + b)       # one rounding to x.dtype at the end

The op sequence is the one ``RMSNorm.forward`` runs, so results are bitwise identical to it
(tested); the only changes are for speed. Options measured with torch 2.13 on this project's
2-core EPYC dev box, one thread, best of 15, microseconds, weight and bias, float32 in and out
(``scripts/bench_kernels.py --cpu`` re-measures them into benchmarks/results/bench_kernels-cpu.json):

=================  =========  ==============  ==========  ==============  ============
(M, N)             LayerNorm  remote forward  F.rms_norm  in-place chain  chunked rows
=================  =========  ==============  ==========  ==============  ============
(1, 768)           2.5        12.0            10.1        11.0
(32, 768)          7.9        17.1            15.5        16.1
(512, 768)         91         151             143         127
(4096, 768)        761        2035            1827        1161
bf16 (4096, 2048)  2574                                   130905          9573
=================  =========  ==============  ==========  ==============  ============

Used: ``F.rms_norm`` (one call into a C++ composite) up to ``SMALL_NUMEL`` elements, where
per-op dispatch dominates; the in-place chain (no temporaries beyond one) above; above
``CHUNK_FROM_NUMEL`` the chain a row chunk at a time, when autograd is off. What no
pure-torch composition reaches is the single fused ``F.layer_norm`` kernel: on CPU an RMSNorm
costs ~8 us more per call than a LayerNorm for small M and 1.3-2x for large M. Rejected:
``torch.compile`` (~20 s compile, ~20 us per call, faster only for M >= 4096), and the exact
but unfused tricks around ``F.layer_norm`` (normalising ``[x, -x]``; recovering ``mean(x**2)``
from ``native_layer_norm``'s statistics), slower than the chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Below this many elements per call F.rms_norm's lower dispatch cost beats the manual chain.
SMALL_NUMEL = 32768
# From this many elements on, rows are normalised a cache-sized chunk at a time: float32
# temporaries of 16 MB and more come from fresh mmaps, and their page faults cost more than
# the extra per-chunk dispatch (bf16 4096 x 2048, one thread, loaded machine: 131 -> 5-10 ms).
CHUNK_FROM_NUMEL = 1 << 22
CHUNK_NUMEL = 1 << 18  # 1 MB of float32: L2-sized on the EPYC


def needs_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call (then in-place ops on saved tensors are avoided)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm_torch(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """y = round(float32(x) * rsqrt(mean(float32(x)**2) + eps) * w + b) over the last dimension.

    Computed in float32, or in x's dtype if wider (float64 stays float64), like RMSNorm.forward.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    w = None if weight is None else weight.to(compute)
    b = None if bias is None else bias.to(compute)
    # (not while compiling: dynamo would unroll the chunk loop)
    if x.numel() >= CHUNK_FROM_NUMEL and not needs_graph(x, weight, bias) and not torch.compiler.is_compiling():
        return _rms_norm_chunked(x, w, b, eps, compute)
    xf = x.to(compute)
    if x.numel() <= SMALL_NUMEL:
        y = F.rms_norm(xf, (x.shape[-1],), w, eps)
    else:
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        y = xf * r
        if w is not None:
            # in place saves an allocation and a pass over memory; out of place under autograd,
            # where mul_ would overwrite the value its own backward needs
            y = y * w if needs_graph(x, weight) else y.mul_(w)
    if b is not None:
        y = y + b if needs_graph(x, weight, bias) else y.add_(b)
    return y.to(x.dtype)


def _rms_norm_chunked(x, w, b, eps, compute):
    """rms_norm_torch for large inputs without autograd: same ops per row, row chunk by chunk."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    step = max(1, CHUNK_NUMEL // n)
    for start in range(0, rows.shape[0], step):
        xf = rows[start : start + step].to(compute)
        part = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        if w is not None:
            part.mul_(w)
        if b is not None:
            part.add_(b)
        y[start : start + step] = part  # the one rounding to x.dtype
    return y.view(x.shape)


def add_rms_norm_torch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_torch(s), s) with s = x + residual rounded to the input dtype, as an unfused add."""
    s = x + residual
    return rms_norm_torch(s, weight, bias, eps), s


def forward_torch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm``'s result on the fallback: y, or (y, s) with a residual (``launch.forward_eager``'s twin)."""
    if residual is None:
        return rms_norm_torch(x, weight, bias, eps)
    return add_rms_norm_torch(x, residual, weight, bias, eps)


def forward_native(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.rms_norm`` on x's dtype, after ``torch.add`` with a residual: one or two native ops, the
    eager calls ``launch.eager_native`` picks (bias-free, weight of x's dtype). Statistics in
    float32 and one rounding of y, as the kernels round; not bitwise the fallback's."""
    s = x if residual is None else x + residual
    y = F.rms_norm(s, (s.shape[-1],), weight, eps)
    return y if residual is None else (y, s)


def rms_norm_backward_torch(
    dy: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None, ds: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of y = x * rstd * w + b in float32 (the Triton backward's CPU twin).

    With x̂ = x * rstd and g = dy * w:  dx = rstd * (g - x̂ * mean(g * x̂)) + ds,
    dw = sum_rows(dy * x̂),  db = sum_rows(dy).  Returns (dx in xs.dtype, dw fp32, db fp32).
    """
    n = xs.shape[-1]
    compute = torch.promote_types(xs.dtype, torch.float32)
    xhat = xs.to(compute) * rstd.unsqueeze(-1)
    dyf = dy.to(compute)
    g = dyf if weight is None else dyf * weight.to(compute)
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    if ds is not None:
        dx = dx + ds.to(compute)
    dw = (dyf * xhat).reshape(-1, n).sum(0)
    db = dyf.reshape(-1, n).sum(0)
    return dx.to(xs.dtype), dw, db


def rms_norm_backward_native(
    dy: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None, ds: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm_backward_torch``'s results through the backward kernel autograd runs for
    ``F.rms_norm`` (``aten._fused_rms_norm_backward``: CUDA, weight of xs's dtype), from the saved
    float32 rstd; elsewhere that function itself. dw, db float32 (db: one sum over rows)."""
    fused = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)
    if fused is None or not xs.is_cuda or (weight is not None and weight.dtype != xs.dtype):
        return rms_norm_backward_torch(dy, xs, rstd, weight, ds)
    n = xs.shape[-1]
    dx, dw = fused(dy.contiguous(), xs.contiguous(), [n], rstd.unsqueeze(-1), weight, [True, weight is not None])
    if ds is not None:
        dx = dx + ds
    db = dy.reshape(-1, n).sum(0, dtype=torch.float32)
    return dx, (dw.float() if dw is not None else db.new_zeros(n)), db


def rms_norm_rstd_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(float32(x)**2) + eps) per row, float32, shape x.shape[:-1]."""
    return torch.rsqrt(x.to(torch.promote_types(x.dtype, torch.float32)).square().mean(-1).add(eps))
