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

One forward kernel serves the four designs ``launch.FWD_DESIGNS`` chooses between by row length
(the host picks the grid and the constexprs): each program loops over row tiles (``BLOCK_M``
rows) ``pid, pid + programs, ...`` with ``tl.range(..., num_stages=NUM_STAGES)``, so with fewer
programs than tiles the next tile's loads are in flight while this one is reduced; W and B are
loaded once per program. A row that fits in registers is two power-of-two sub-tiles, ``TILE_A`` +
``TILE_B`` (768 = 512 + 256, 5120 = 4096 + 1024), so few lanes idle; longer rows (``LOOP``) take
two passes over ``TILE_A``-sized chunks, sum of squares then scale, the second pass re-reading
the row while it is still in L2 (one program per row, so a row is re-read soon after it was
first read). Contiguous rows with 16-byte aligned pointers and N a multiple of 8 compile to
128-bit loads and stores (``aot_check`` reports the widths).

Backward: for rows that fit in registers, one block of consecutive rows a program, dw and db
accumulated elementwise in registers and written as per-program partial sums, summed by the host
(skipping db without a bias); for long rows dx in two passes per row and dw, db from a separate
column-parallel kernel.
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
def _load_sum(X, R, S, x_off, r_off, s_off, mask, HAS_R: tl.constexpr):
    """s = R(x + residual), stored at ``s_off`` (x alone without a residual), as float32."""
    x = tl.load(X + x_off, mask=mask, other=0.0)
    if HAS_R:
        res = tl.load(R + r_off, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + s_off, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _store_normed(Y, y_off, x, rstd, w, b, mask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """y = R(x * rstd * w + b) for a row tile, stored at ``y_off``; w, b loaded once per program."""
    y = x * rstd[:, None]
    if HAS_W:
        y = y * w[None, :]
    if HAS_B:
        y = y + b[None, :]
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_fwd_kernel(
    X, R, W, B, Y, S, RSTD,
    M, N,
    x_inner, sx_outer, sx_inner, r_inner, sr_outer, sr_inner,
    eps,
    BLOCK_M: tl.constexpr, TILE_A: tl.constexpr, TILE_B: tl.constexpr, LOOP: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, STORE_RSTD: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Forward over row tiles ``pid, pid + programs, ...``; same math and roundings as above.

    Without LOOP a row is columns [0, TILE_A) plus [TILE_A, TILE_A + TILE_B) (TILE_B may be 0),
    TILE_A <= N, both powers of two. With LOOP (BLOCK_M == 1) it is TILE_A-sized chunks.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = tl.cdiv(M, BLOCK_M)
    ca = tl.arange(0, TILE_A)

    if not LOOP:
        wa = 0.0  # stand-ins for absent weight / bias, never read where HAS_W / HAS_B is off
        ba = 0.0
        wb = 0.0
        bb = 0.0
        if HAS_W:
            wa = tl.load(W + ca).to(tl.float32)
        if HAS_B:
            ba = tl.load(B + ca).to(tl.float32)
        if TILE_B > 0:
            cb = TILE_A + tl.arange(0, TILE_B)
            cb_ok = cb < N
            if HAS_W:
                wb = tl.load(W + cb, mask=cb_ok, other=0.0).to(tl.float32)
            if HAS_B:
                bb = tl.load(B + cb, mask=cb_ok, other=0.0).to(tl.float32)
        for tile in tl.range(pid, tiles, programs, num_stages=NUM_STAGES):
            rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M * N may pass 2**31
            row_ok = rows < M
            x_row = _row_offsets(rows, x_inner, sx_outer, sx_inner)[:, None]
            r_row = _row_offsets(rows, r_inner, sr_outer, sr_inner)[:, None]
            out_row = (rows * N)[:, None]
            ma = row_ok[:, None] & (ca < N)[None, :]
            xa = _load_sum(X, R, S, x_row + ca[None, :], r_row + ca[None, :], out_row + ca[None, :], ma, HAS_R)
            ss = _sum(xa * xa, axis=1)
            if TILE_B > 0:
                mb = row_ok[:, None] & cb_ok[None, :]
                xb = _load_sum(X, R, S, x_row + cb[None, :], r_row + cb[None, :], out_row + cb[None, :], mb, HAS_R)
                ss += _sum(xb * xb, axis=1)
            rstd = tl.rsqrt(ss / N + eps)
            _store_normed(Y, out_row + ca[None, :], xa, rstd, wa, ba, ma, HAS_W, HAS_B)
            if TILE_B > 0:
                _store_normed(Y, out_row + cb[None, :], xb, rstd, wb, bb, mb, HAS_W, HAS_B)
            if STORE_RSTD:
                tl.store(RSTD + rows, rstd, mask=row_ok)
    else:
        for r in tl.range(pid, M, programs):
            row = tl.cast(r, tl.int64)
            x_row = _row_offsets(row, x_inner, sx_outer, sx_inner)
            r_row = _row_offsets(row, r_inner, sr_outer, sr_inner)
            acc = tl.full([TILE_A], 0.0, tl.float32)
            for start in tl.range(0, N, TILE_A, num_stages=NUM_STAGES):
                c = start + ca
                xf = _load_sum(X, R, S, x_row + c, r_row + c, row * N + c, c < N, HAS_R)
                acc += xf * xf
            rstd = tl.rsqrt(_sum(acc, axis=0) / N + eps)
            if HAS_R:
                tl.debug_barrier()  # the second pass reads s back: this block's stores first
            for start in tl.range(0, N, TILE_A, num_stages=NUM_STAGES):
                c = start + ca
                mask = c < N
                if HAS_R:
                    x = tl.load(S + row * N + c, mask=mask, other=0.0)
                else:
                    x = tl.load(X + x_row + c, mask=mask, other=0.0)
                y = x.to(tl.float32) * rstd
                if HAS_W:
                    y = y * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_B:
                    y = y + tl.load(B + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(Y + row * N + c, y.to(Y.dtype.element_ty), mask=mask)
            if STORE_RSTD:
                tl.store(RSTD + row, rstd)


@triton.jit
def rms_norm_bwd_rows_kernel(
    DY, X, W, RSTD, DS, DX, DW_PART, DB_PART,
    M, N, x_inner, sx_outer, sx_inner, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Backward of y = x * rstd * w + b for rows that fit in registers, one block of rows a program.

    With x̂ = x * rstd and g = dy * w:  dx = rstd * (g - x̂ * sum(g * x̂) / N) + ds.

    Program p takes rows [p * rows_per_program, (p + 1) * rows_per_program), BLOCK_M at a time
    (several short rows a step, so each step has enough bytes in flight), pipelined. dy * x̂ (and
    dy when HAS_B) accumulate elementwise in a [BLOCK_M, BLOCK_N] register tile, reduced over its
    rows once at the end into row p of DW_PART / DB_PART; the host sums those rows (the second
    stage of the dw reduction, as Liger's and quack's backwards do).
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc_w = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    if HAS_B:
        acc_b = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    first = tl.cast(pid, tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in tl.range(first, last, BLOCK_M, num_stages=NUM_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        out = (rows * N)[:, None] + cols[None, :]
        x = tl.load(X + _row_offsets(rows, x_inner, sx_outer, sx_inner)[:, None] + cols[None, :], mask=mask,
                    other=0.0)  # fmt: skip
        dy = tl.load(DY + out, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = x.to(tl.float32) * rstd[:, None]
        g = dy
        if HAS_W:
            g = dy * w[None, :]
        dx = (g - xhat * (_sum(g * xhat, axis=1) / N)[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + out, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=mask)
        acc_w += dy * xhat
        if HAS_B:
            acc_b += dy
    part_row = tl.cast(pid, tl.int64) * N
    tl.store(DW_PART + part_row + cols, _sum(acc_w, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + part_row + cols, _sum(acc_b, axis=0), mask=col_ok)


@triton.jit
def rms_norm_bwd_kernel(
    DY, X, W, RSTD, DS, DX,
    M, N, x_inner, sx_outer, sx_inner,
    BLOCK_N: tl.constexpr, HAS_W: tl.constexpr, HAS_DS: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """dx for long rows, rows ``pid, pid + programs, ...``: two passes over BLOCK_N chunks of a
    row (sum(g * x), then dx), pipelined; dw and db come from ``rms_norm_bwd_dw_kernel``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    for r in tl.range(pid, M, programs):
        row = tl.cast(r, tl.int64)
        x_row = _row_offsets(row, x_inner, sx_outer, sx_inner)
        rstd = tl.load(RSTD + row)
        acc = tl.full([BLOCK_N], 0.0, tl.float32)
        for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
            c = start + cols
            mask = c < N
            x = tl.load(X + x_row + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(DY + row * N + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                g = g * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            acc += g * x
        mean_gx = _sum(acc, axis=0) * rstd / N
        for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
            c = start + cols
            mask = c < N
            xhat = tl.load(X + x_row + c, mask=mask, other=0.0).to(tl.float32) * rstd
            g = tl.load(DY + row * N + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                g = g * tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            dx = (g - xhat * mean_gx) * rstd
            if HAS_DS:
                dx += tl.load(DS + row * N + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * N + c, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_dw_kernel(
    DY, X, RSTD, DW_PART, DB_PART,
    M, N, x_inner, sx_outer, sx_inner, rows_per_split,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_B: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Column-parallel dw = sum_rows(dy * x * rstd) and db = sum_rows(dy) for long rows.

    Program (c, s) sums columns [c * BLOCK_C, (c + 1) * BLOCK_C) over rows
    [s * rows_per_split, (s + 1) * rows_per_split) into row s of DW_PART / DB_PART.
    """
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < N
    first = tl.cast(pid_s, tl.int64) * rows_per_split
    last = tl.minimum(first + rows_per_split, M)
    acc_w = tl.full([BLOCK_R, BLOCK_C], 0.0, tl.float32)
    if HAS_B:
        acc_b = tl.full([BLOCK_R, BLOCK_C], 0.0, tl.float32)
    for start in tl.range(first, last, BLOCK_R, num_stages=NUM_STAGES):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = rows < last
        mask = row_ok[:, None] & c_ok[None, :]
        x = tl.load(X + _row_offsets(rows, x_inner, sx_outer, sx_inner)[:, None] + c[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + (rows * N)[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        acc_w += dy * (x.to(tl.float32) * rstd[:, None])
        if HAS_B:
            acc_b += dy
    part = tl.cast(pid_s, tl.int64) * N + c
    tl.store(DW_PART + part, _sum(acc_w, axis=0), mask=c_ok)
    if HAS_B:
        tl.store(DB_PART + part, _sum(acc_b, axis=0), mask=c_ok)
