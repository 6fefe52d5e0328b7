"""Raw Triton RMSNorm kernels. Imported lazily by ``rms_norm.py``.

Lazily, because ``triton.jit`` chooses between compiling and interpreting (``TRITON_INTERPRET=1``)
when it decorates, i.e. when this module is imported: importing it only on first use lets a test
set the variable after normswap itself was imported. For the same reason the kernels avoid
``@triton.jit`` functions of triton's standard library (``tl.zeros``; ``tl.sum`` see ``_sum``),
which is decorated when triton is first imported (transformers imports it), maybe before.

Layout: a tensor (..., N) is seen as M rows of N contiguous elements; the address of row m is
``(m // inner) * s_outer + (m % inner) * s_inner`` (per input), which covers any 2-D strided view and any 3-D
view whose last dimension is contiguous (e.g. ``h[:, 1:]`` or ``qkv[..., :d]``) without a copy.
Row offsets are int64 so M * N >= 2**31 addresses correctly.

Forward, per row (fp32 throughout, roundings marked R):

    s = R(x + residual)                        stored, then normalised (as an unfused add would)
    rstd = rsqrt(sum(s * s) / N + eps)
    y = R(s * rstd * w + b)

Rows that fit one tile of at most ``BLOCK_N`` elements are normalised from registers,
``BLOCK_M`` rows per program (BLOCK_M > 1 for small N and many rows, e.g. per-head q/k norms).
Longer rows (``LOOP``) take two passes over ``BLOCK_N``-sized chunks: sum of squares, then scale.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _stdlib_mismatched() -> bool:
    """Whether this module is interpreted while triton's standard library was compiled.

    That happens when triton was imported (by transformers, say) before ``TRITON_INTERPRET=1``
    was set; the interpreter then cannot call ``tl.sum``, a ``@triton.jit`` function of that
    library, so the kernels reduce with ``tl.reduce`` and a combine function of their own. It is
    the same reduction (``tl.sum`` is written that way), only slower to interpret.
    """
    import triton.language.standard as standard  # noqa: PLC0415

    interpreting = triton.knobs.runtime.interpret
    return interpreting and type(standard.sum).__name__ != "InterpretedFunction"


@triton.jit
def _add(a, b):
    return a + b


if _stdlib_mismatched():

    @triton.jit
    def _sum(x, axis):
        return tl.reduce(x, axis, _add)

else:

    @triton.jit
    def _sum(x, axis):
        return tl.sum(x, axis=axis)


@triton.jit
def _row_offsets(rows, inner, s_outer, s_inner):
    return (rows // inner) * s_outer + (rows % inner) * s_inner


@triton.jit
def rms_norm_fwd_kernel(
    X, R, W, B, Y, S, RSTD,
    M, N,
    x_inner, sx_outer, sx_inner, r_inner, sr_outer, sr_inner,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_row = _row_offsets(rows, x_inner, sx_outer, sx_inner)[:, None]
    r_row = _row_offsets(rows, r_inner, sr_outer, sr_inner)[:, None]
    out_row = (rows * N)[:, None]  # Y and S are contiguous (M, N)
    cols = tl.arange(0, BLOCK_N)

    if not LOOP:
        mask = row_ok[:, None] & (cols < N)[None, :]
        x = tl.load(X + x_row + cols[None, :], mask=mask, other=0.0)
        if HAS_R:
            res = tl.load(R + r_row + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(S.dtype.element_ty)
            tl.store(S + out_row + cols[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(_sum(xf * xf, axis=1) / N + eps)
        y = xf * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + out_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # pass 1: sum of squares (and s = x + residual, stored for pass 2 and the caller)
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = tl.load(X + x_row + c[None, :], mask=mask, other=0.0)
            if HAS_R:
                res = tl.load(R + r_row + c[None, :], mask=mask, other=0.0)
                x = (x.to(tl.float32) + res.to(tl.float32)).to(S.dtype.element_ty)
                tl.store(S + out_row + c[None, :], x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(_sum(acc, axis=1) / N + eps)
        if HAS_R:
            tl.debug_barrier()  # pass 2 reads s back; make this block's stores visible first
        # pass 2: scale; the row is re-read, mostly from L2
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            if HAS_R:
                x = tl.load(S + out_row + c[None, :], mask=mask, other=0.0)
            else:
                x = tl.load(X + x_row + c[None, :], mask=mask, other=0.0)
            y = x.to(tl.float32) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
            if HAS_B:
                y = y + tl.load(B + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + out_row + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(
    DY, X, W, RSTD, DS, DX, DW_PART, DB_PART,
    M, N, x_inner, sx_outer, sx_inner, rows_per_program,
    BLOCK_N: tl.constexpr, LOOP: tl.constexpr,
    HAS_W: tl.constexpr, HAS_DS: tl.constexpr,
):  # fmt: skip
    """Backward of y = x * rstd * w + b for ``rows_per_program`` consecutive rows.

    With x̂ = x * rstd and g = dy * w:  dx = rstd * (g - x̂ * sum(g * x̂) / N) + ds.
    Each program also writes its partial sums of dy * x̂ (dw) and dy (db) to its own row of
    DW_PART / DB_PART (fp32, (programs, N)); the host sums them, so no atomics are needed.
    DY, DS and DX are contiguous (M, N); X uses the strided row layout of the forward.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    part_row = pid.to(tl.int64) * N
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)  # bounding the loop keeps row masks out

    if not LOOP:
        col_ok = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.full([BLOCK_N], 0.0, tl.float32)
        db = tl.full([BLOCK_N], 0.0, tl.float32)
        for row in range(first, last):
            mask = col_ok
            x = tl.load(X + _row_offsets(row, x_inner, sx_outer, sx_inner) + cols, mask=mask, other=0.0)
            dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x.to(tl.float32) * rstd
            g = dy
            if HAS_W:
                g = dy * w
            dx = (g - xhat * (_sum(g * xhat, axis=0) / N)) * rstd
            if HAS_DS:
                dx += tl.load(DS + row * N + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        tl.store(DW_PART + part_row + cols, dw, mask=col_ok)
        tl.store(DB_PART + part_row + cols, db, mask=col_ok)
    else:
        # DW_PART / DB_PART arrive zeroed; this program owns its row of them
        for row in range(first, last):
            x_row = _row_offsets(row, x_inner, sx_outer, sx_inner)
            rstd = tl.load(RSTD + row)
            acc = tl.full([BLOCK_N], 0.0, tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                x = tl.load(X + x_row + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * N + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    dy = dy * tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                acc += dy * x
            mean_gx = _sum(acc, axis=0) * rstd / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = c < N
                xhat = tl.load(X + x_row + c, mask=mask, other=0.0).to(tl.float32) * rstd
                dy = tl.load(DY + row * N + c, mask=mask, other=0.0).to(tl.float32)
                g = dy
                if HAS_W:
                    g = dy * tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
                dx = (g - xhat * mean_gx) * rstd
                if HAS_DS:
                    dx += tl.load(DS + row * N + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + row * N + c, dx.to(DX.dtype.element_ty), mask=mask)
                part = part_row + c
                tl.store(DW_PART + part, tl.load(DW_PART + part, mask=c < N) + dy * xhat, mask=c < N)
                tl.store(DB_PART + part, tl.load(DB_PART + part, mask=c < N) + dy, mask=c < N)
