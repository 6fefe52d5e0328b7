"""RMSNorm op: Triton launch code, ``torch.library`` custom ops, autograd, and the public function.

``rms_norm(x, weight, bias, eps, residual)`` runs the Triton kernels (``_triton_rms_norm.py``) on
CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests exercise them);
everywhere else it runs the exact torch fallback (``normswap.kernels.fallback``).

The kernel path goes through two custom ops, ``normswap::rms_norm_fwd`` and
``normswap::rms_norm_bwd``, each with a fake (meta) implementation, and the forward op has a
registered autograd formula; ``torch.compile(fullgraph=True)`` therefore traces through them
without a graph break, and ``eps`` is a runtime float, so new eps values do not recompile.

Rounding points (identical to ``normswap.modeling.remote.RMSNorm`` preceded by an unfused add)::

    s    = round_dtype(float32(x) + float32(residual))      # stored; what is normalised
    rstd = rsqrt(sum(float32(s)**2) / N + eps)               # float32
    y    = round_dtype(float32(s) * rstd * float32(w) + float32(b))
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from ..fallback import (
    add_rms_norm_torch,
    needs_graph,
    rms_norm_backward_torch,
    rms_norm_rstd_torch,
    rms_norm_torch,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Rows up to this many elements are normalised from registers, longer ones in two looped passes.
MAX_FUSED_N = 16384
# Chunk length of the looped passes.
LOOP_BLOCK_N = 4096
# Small-N rows are packed BLOCK_M to a program until a tile holds this many elements.
MULTI_ROW_TILE = 4096
# ... but only while at least this many programs remain to fill the GPU.
MIN_PROGRAMS = 1024


def interpret_mode() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_kernels(x: torch.Tensor) -> bool:
    """Whether ``rms_norm`` sends ``x`` to the Triton kernels rather than the torch fallback."""
    if not (x.is_cuda or (x.is_cpu and interpret_mode())):  # the common CPU exit first
        return False
    if not HAS_TRITON:
        _warn_no_triton()
        return False
    return x.dtype in KERNEL_DTYPES and x.dim() >= 1 and x.shape[-1] >= 1


@functools.cache
def _warn_no_triton() -> None:
    from normswap.extras import install_hint

    warnings.warn(f"normswap: Triton is not installed, so RMSNorm runs on the torch fallback; "
                  f"the fused kernels come with the 'kernels' extra: {install_hint('kernels')}", stacklevel=3)


@functools.cache
def _kernels():
    from . import _triton_rms_norm  # noqa: PLC0415  (lazy: see that module's docstring)

    return _triton_rms_norm


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _row_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(INNER, s_outer, s_inner) addressing row m of ``t`` viewed as (M, N), or None if impossible.

    Row m lives at ``(m // INNER) * s_outer + (m % INNER) * s_inner``. Leading dimensions that
    are contiguous with each other merge; more than two unmergeable ones need a copy.
    """
    if t.shape[-1] != 1 and t.stride(-1) != 1:
        return None
    dims: list[list[int]] = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    # INNER == 1 whenever one stride suffices: triton specialises the value 1, so the kernel's
    # 64-bit division and modulo by INNER fold away
    if not dims:
        return 1, 0, 0
    if len(dims) == 1:
        return 1, dims[0][1], 0
    if len(dims) == 2:
        return dims[1][0], dims[0][1], dims[1][1]
    return None


def _strided_rows(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` (copied only when no 2-level row layout exists) and its row layout."""
    layout = _row_layout(t)
    if layout is None:
        t = t.contiguous()
        layout = _row_layout(t)
    return t, layout


def _fwd_config(m: int, n: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, LOOP, num_warps) for an (m, n) forward."""
    if n > MAX_FUSED_N:
        return 1, LOOP_BLOCK_N, True, _warps_for(LOOP_BLOCK_N)
    block_n = _next_pow2(n)
    # pack rows only when enough of them remain to keep MIN_PROGRAMS programs in flight
    block_m = max(1, min(MULTI_ROW_TILE // block_n, _pow2_floor(m // MIN_PROGRAMS)))
    return block_m, block_n, False, _warps_for(block_m * block_n)


def _warps_for(tile: int) -> int:
    """About 8 elements per thread: sm_90 cubins of 16-32 per thread use 150+ registers (see
    ``python -m normswap.kernels.aot_check``), which caps occupancy at one CTA per SM."""
    return max(4, min(32, tile // 256))


@functools.cache
def _program_slots(device: torch.device) -> int:
    """How many backward programs to run: two per SM on CUDA, a few in the interpreter."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _fwd_triton(x, weight, bias, residual, eps, store_rstd=True):
    """(y, s or None, rstd or None). Lean on purpose: at decode sizes launch overhead is the cost."""
    n = x.shape[-1]
    m = x.numel() // n
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) if store_rstd else None
    if m == 0:
        return y, s, rstd
    x, x_layout = _strided_rows(x)
    r_layout = (1, 0, 0)
    if residual is not None:
        residual, r_layout = _strided_rows(residual)
    block_m, block_n, loop, num_warps = _fwd_config(m, n)
    w = weight.contiguous() if weight is not None else y
    b = bias.contiguous() if bias is not None else y
    _kernels().rms_norm_fwd_kernel[(_cdiv(m, block_m),)](
        x, residual if residual is not None else x, w, b, y, s if s is not None else y,
        rstd if rstd is not None else y,
        m, n, *x_layout, *r_layout, eps,
        BLOCK_M=block_m, BLOCK_N=block_n, LOOP=loop,
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_R=residual is not None,
        STORE_RSTD=store_rstd, num_warps=num_warps,
    )  # fmt: skip
    return y, s, rstd


def _bwd_triton(dy, xs, rstd, weight, ds):
    n = xs.shape[-1]
    m = xs.numel() // n
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device)
    if m == 0:
        zeros = torch.zeros(n, dtype=torch.float32, device=xs.device)
        return dx, zeros, zeros.clone()
    xs, x_layout = _strided_rows(xs)
    dy = dy.contiguous()
    ds = ds.contiguous() if ds is not None else None
    programs = min(m, _program_slots(xs.device))
    rows_per_program = _cdiv(m, programs)
    programs = _cdiv(m, rows_per_program)
    loop = n > MAX_FUSED_N
    block_n = LOOP_BLOCK_N if loop else _next_pow2(n)
    alloc = torch.zeros if loop else torch.empty  # the looped kernel accumulates in place
    dw_part = alloc((programs, n), dtype=torch.float32, device=xs.device)
    db_part = alloc((programs, n), dtype=torch.float32, device=xs.device)
    num_warps = max(8, min(32, block_n // 128))  # ~4 per thread: the backward keeps 5 row arrays live
    _kernels().rms_norm_bwd_kernel[(programs,)](
        dy, xs, weight.contiguous() if weight is not None else dy, rstd.contiguous(),
        ds if ds is not None else dy, dx, dw_part, db_part,
        m, n, *x_layout, rows_per_program,
        BLOCK_N=block_n, LOOP=loop, HAS_W=weight is not None, HAS_DS=ds is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_part.sum(0), db_part.sum(0)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("normswap::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, s, rstd): s = x + residual (empty without a residual), y = RMSNorm(s), rstd per row."""
    if use_kernels(x):
        y, s, rstd = _fwd_triton(x, weight, bias, residual, eps)
        return y, (s if s is not None else x.new_empty(0)), rstd
    if residual is None:
        y, s = rms_norm_torch(x, weight, bias, eps), x
    else:
        y, s = add_rms_norm_torch(x, residual, weight, bias, eps)
    rstd = rms_norm_rstd_torch(s, eps).float()  # the schema's dtype, even for float64 x
    s = s.contiguous() if residual is not None else x.new_empty(0)
    return y.contiguous(), s, rstd


@rms_norm_fwd.register_fake
def _(x, weight, bias, residual, eps):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else x.new_empty(0)
    return y, s, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("normswap::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    xs: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    ds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) of y = xs * rstd * w + b, plus ds (the gradient reaching s) into dx.

    dx has xs's dtype; dw and db are float32 sums over rows (the caller casts them).
    """
    if use_kernels(xs):
        return _bwd_triton(dy, xs, rstd, weight, ds)
    dx, dw, db = rms_norm_backward_torch(dy, xs, rstd, weight, ds)
    return dx.contiguous(), dw, db


@rms_norm_bwd.register_fake
def _(dy, xs, rstd, weight, ds):
    n = xs.shape[-1]
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device)
    return dx, xs.new_empty(n, dtype=torch.float32), xs.new_empty(n, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _eps = inputs
    _y, s, rstd = output
    ctx.save_for_backward(s if residual is not None else x, weight, rstd)
    ctx.has_residual = residual is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy, ds, _drstd):
    xs, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(xs)
    ds = ds if ctx.has_residual and ds is not None and ds.numel() else None
    dx, dw, db = torch.ops.normswap.rms_norm_bwd(dy, xs, rstd, weight, ds)
    dweight = dw.to(weight.dtype) if weight is not None else None
    dbias = db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return dx, dweight, dbias, (dx if ctx.has_residual else None), None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public function


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    Without ``residual``: ``y = x / sqrt(mean(x**2) + eps) * weight + bias``.
    With ``residual``: ``s = x + residual`` and returns ``(y, s)`` with y the RMSNorm of s, in
    one pass over memory on the kernel path. Statistics, weight multiply and bias add are in
    float32; s and y are each rounded once to x's dtype (see the module docstring).
    """
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        s = x + residual  # broadcasting or type promotion: leave it to torch, then normalise
        return rms_norm(s, weight, bias, eps), s
    if use_kernels(x):
        if torch.compiler.is_compiling() or needs_graph(x, weight, bias, residual):
            y, s, _ = torch.ops.normswap.rms_norm_fwd(x, weight, bias, residual, float(eps))
        else:
            # eager inference: skip the custom-op dispatch (Python-level, ~µs that matter at decode)
            y, s, _ = _fwd_triton(x, weight, bias, residual, float(eps), store_rstd=False)
        return (y, s) if residual is not None else y
    if residual is None:
        return rms_norm_torch(x, weight, bias, eps)
    return add_rms_norm_torch(x, residual, weight, bias, eps)
