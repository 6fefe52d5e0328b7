"""Host side of the Triton RMSNorm path: row layouts, launch configurations, cached launches.

``forward`` and ``backward`` run the kernels of ``_triton_rms_norm.py``: a few programs per SM,
each looping over row tiles (see that module).

Decode calls are small (M = 1-32 rows), so their cost is host time. A forward's launch plan
(row layouts, configuration, grid, and on CUDA the compiled kernel's launcher) is cached per
(shapes, strides, dtypes, pointer alignment): a repeated call allocates its outputs and
launches, nothing more. Alignment is in the key because Triton specialises a kernel on whether
each pointer is 16-byte aligned.

On CUDA the forward picks its warps by timing a few candidates on first use of each
(N, dtypes, flags) with at least ``TUNE_FROM_NUMEL`` elements (never while a CUDA graph is
being captured); smaller calls are launch-bound and use the heuristic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .fallback import forward_native

# Rows up to this many 16-bit elements are normalised from registers, longer ones in two looped
# passes; half as many float32 elements, a quarter as many in the backward, which keeps more row
# arrays live (beyond that ptxas spills, see ``python -m normswap.kernels.aot_check``).
MAX_FUSED_N = 16384
# Chunk length of the looped passes.
LOOP_BLOCK_N = 4096
# Small-N rows are packed BLOCK_M to a program until a tile holds this many elements.
MULTI_ROW_TILE = 4096
# ... but only while at least this many tiles remain to spread over the GPU.
MIN_PROGRAMS = 1024
# Loads in flight per program in the pipelined loops.
NUM_STAGES = 2
# Forward calls with at least this many elements tune their warps (CUDA).
TUNE_FROM_NUMEL = 1 << 20
WARP_CHOICES = (4, 8, 16)


@functools.cache
def kernels():
    """The raw kernel module, imported on first use (see ``_triton_rms_norm``'s docstring)."""
    from . import _triton_rms_norm  # noqa: PLC0415

    return _triton_rms_norm


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- row layouts


def row_layout(t: torch.Tensor) -> tuple[int, int, int] | None:
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
    layout = row_layout(t)
    if layout is None:
        t = t.contiguous()
        layout = row_layout(t)
    return t, layout


# --------------------------------------------------------------------------- configurations

# The forward design by row length, per element size: the first entry whose bound is at least N.
# ``multirow``: several short rows a tile, a few programs per SM looping over tiles;
# ``persistent``: one row a tile (in registers), same grid; ``row``: one program per row, the row
# in registers, no loop (occupancy hides latency, as Inductor's persistent reductions do);
# ``reload``: one program per row, two passes over chunks, the second re-reading the row from L2
# instead of holding it in registers (quack re-reads from shared memory above 8K).
FWD_DESIGNS = {
    2: ((2048, "multirow"), (8192, "persistent"), (16384, "row"), (None, "reload")),
    4: ((1024, "multirow"), (4096, "persistent"), (8192, "row"), (None, "reload")),
}
DESIGNS = ("multirow", "persistent", "row", "reload")
NATIVE_POLICIES = ("table", "never", "always")
# How a call torch.compile traces on the kernel path computes the norm: "decompose", the torch ops
# of the fallback, which Inductor fuses with their neighbours (the residual add, the casts) into
# its own kernels; or "kernel", the opaque custom op running normswap's kernel.
COMPILE_PATHS = ("decompose", "kernel")


@dataclass(frozen=True)
class DispatchConfig:
    """How calls reach the kernels: one object, replaced (never mutated) by ``configure`` and
    ``dispatch``.

    ``design``: a forward design forced where the row fits it (the benchmark times each side by
    side), or None: ``FWD_DESIGNS``. ``native``: which eager calls take the native ops
    (``F.rms_norm``, after ``torch.add`` when fused) instead of a Triton launch: "table", CUDA
    calls where ``crossover`` measured them faster; "never"; "always", every call they can compute
    (also on the CPU, for tests). Never while a CUDA graph is captured, and only bias-free calls
    whose weight has x's dtype (a bias needs a rounding point ``F.rms_norm`` lacks). The same
    policy picks the backward (``crossover.BACKWARD``). ``fast_launch``: cached launchers of
    compiled kernels (False: triton's JIT launch each call). ``direct_launch``: the cached launcher
    calls the compiled kernel's entry point directly (False: triton's ``compiled[grid]``); both
    turn off by themselves when this triton refuses them. ``compile_path``: ``COMPILE_PATHS``.
    """

    design: str | None = None
    native: str = "table"
    fast_launch: bool = True
    direct_launch: bool = True
    compile_path: str = "decompose"

    def __post_init__(self) -> None:
        if self.design is not None and self.design not in DESIGNS:
            raise ValueError(f"design must be None or one of {DESIGNS}, not {self.design!r}")
        if self.native not in NATIVE_POLICIES:
            raise ValueError(f"native must be one of {NATIVE_POLICIES}, not {self.native!r}")
        if self.compile_path not in COMPILE_PATHS:
            raise ValueError(f"compile path must be one of {COMPILE_PATHS}, not {self.compile_path!r}")


CONFIG = DispatchConfig()


def dispatch_config() -> DispatchConfig:
    """The dispatch configuration in force."""
    return CONFIG


@functools.cache
def _replaced(config: DispatchConfig, changes: tuple) -> DispatchConfig:
    return dataclasses.replace(config, **dict(changes))


def configure(**changes) -> DispatchConfig:
    """Put ``DispatchConfig`` fields ``changes`` in force; returns the configuration before. The
    eager plans cached per norm module are dropped (``generation``); launch plans are keyed by
    the fields they depend on."""
    global CONFIG, generation
    old, CONFIG = CONFIG, _replaced(CONFIG, tuple(sorted(changes.items())))
    generation += 1
    return old


@contextlib.contextmanager
def dispatch(**changes) -> Iterator[DispatchConfig]:
    """``configure(**changes)`` for the duration of the block."""
    old = configure(**changes)
    try:
        yield CONFIG
    finally:
        configure(**old.__dict__)


def fwd_design(n: int, element_size: int) -> str:
    """The forward design ``FWD_DESIGNS`` picks for rows of ``n`` elements."""
    if CONFIG.design is not None:
        return "reload" if n > max_fused_n(element_size) else CONFIG.design
    for bound, design in FWD_DESIGNS[4 if element_size > 2 else 2]:
        if bound is None or n <= bound:
            return design
    raise AssertionError("the last design has no bound")


@dataclass(frozen=True)
class FwdConfig:
    """One forward launch: rows per tile, columns (``tile_a`` + ``tile_b``, or ``tile_a``-sized
    chunks when ``loop``), warps, programs, pipeline stages and the design they implement."""

    block_m: int
    tile_a: int
    tile_b: int
    loop: bool
    num_warps: int
    programs: int
    num_stages: int = NUM_STAGES
    design: str = "persistent"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 in the interpreter (few programs, so tests
    still give each program several tiles)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _default_warps(tile: int) -> int:
    """About 16 elements per thread, 4-16 warps: with two tiles in flight per program."""
    return max(4, min(16, tile // 512))


def max_fused_n(element_size: int, backward: bool = False) -> int:
    """The longest row normalised from registers."""
    if backward:
        return MAX_FUSED_N // 4
    return MAX_FUSED_N // 2 if element_size > 2 else MAX_FUSED_N


def fwd_config(
    m: int, n: int, device: torch.device, num_warps: int | None = None, element_size: int = 2
) -> FwdConfig:
    """The forward configuration for (m, n) rows (``num_warps`` overrides the warps)."""
    design = fwd_design(n, element_size)
    sms = multiprocessors(device)
    if design == "reload":
        # 16-byte vectors: 8 16-bit (4 fp32) elements a thread per chunk
        warps = num_warps or max(4, min(16, LOOP_BLOCK_N * element_size // (16 * 32)))
        return FwdConfig(1, LOOP_BLOCK_N, 0, True, warps, m, NUM_STAGES, design)
    padded = _next_pow2(n)
    tile_a = _pow2_floor(n)
    tile_b = _next_pow2(n - tile_a) if n > tile_a else 0
    if design == "row":
        warps = num_warps or max(4, min(16, padded * element_size // (64 * 32)))
        return FwdConfig(1, tile_a, tile_b, False, warps, m, 1, design)
    block_m = 1
    if design == "multirow":
        block_m = max(1, min(MULTI_ROW_TILE // padded, _pow2_floor(m // MIN_PROGRAMS)))
    warps = num_warps or _default_warps(block_m * padded)
    programs = min(_cdiv(m, block_m), sms * max(1, 32 // warps))
    return FwdConfig(block_m, tile_a, tile_b, False, warps, programs, NUM_STAGES, design)


def warp_candidates(config: FwdConfig, element_size: int) -> list[int]:
    """Warps worth timing for ``config``: at least 2 elements and at most 64 bytes of a tile per
    thread (more spills once two tiles are in flight, see ``aot_check``); the row and reload
    designs keep their heuristic."""
    if config.design in ("row", "reload"):
        return [config.num_warps]
    tile = config.block_m * _next_pow2(config.tile_a + config.tile_b)
    return [w for w in WARP_CHOICES if tile // (32 * w) >= 2 and tile * element_size // (32 * w) <= 64] or [
        config.num_warps
    ]


# --------------------------------------------------------------------------- forward

@dataclass
class _Plan:
    kernel: object
    grid: tuple[int]
    consts: tuple
    num_warps: int
    copy_x: bool
    copy_r: bool
    contiguous_w: bool
    contiguous_b: bool
    x_layout: tuple[int, int, int]
    r_layout: tuple[int, int, int]
    m: int = 0
    n: int = 0
    like_x: bool = False  # x is contiguous: outputs come from empty_like(x), the cheaper allocation
    native: bool = False  # the native ops compute this call eagerly (``eager_native``)
    cuda: bool = False
    launcher: object = None  # the compiled kernel's launcher (CUDA), once known
    direct: object = None  # that launcher when it is a direct_launcher
    fixups: bool = False  # an argument needs a copy or a contiguous weight first (``_fwd_args``)
    head: tuple = ()  # the scalar arguments before eps: m, n, the row layouts

    def __post_init__(self) -> None:
        self.fixups = self.copy_x or self.copy_r or not (self.contiguous_w and self.contiguous_b)
        self.head = (self.m, self.n, *self.x_layout, *self.r_layout)

    def tail(self, eps: float) -> tuple:
        """The kernel's arguments after the tensors: ``head``, eps, the constexprs."""
        return (*self.head, eps, *self.consts)


_PLANS: dict[tuple, _Plan] = {}
# a bound on cached plans: prefill with ever-new sequence lengths adds one per shape
MAX_PLANS = 4096
_TUNED: dict[tuple, int] = {}


def _aligned(t: torch.Tensor | None) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def _plan_key(x, weight, bias, residual, store_rstd: bool) -> tuple:
    return (
        x.device, x.dtype, x.shape, x.stride(), x.data_ptr() % 16 == 0,
        None if residual is None else (residual.stride(), _aligned(residual)),
        None if weight is None else (weight.dtype, weight.is_contiguous(), _aligned(weight)),
        None if bias is None else (bias.dtype, bias.is_contiguous(), _aligned(bias)),
        store_rstd, CONFIG.design, CONFIG.native,
    )  # fmt: skip


def _fwd_consts(config: FwdConfig, has_w: bool, has_b: bool, has_r: bool, store_rstd: bool) -> tuple:
    """The kernel's constexpr arguments, in its parameter order."""
    return (config.block_m, config.tile_a, config.tile_b, config.loop, has_w, has_b, has_r, store_rstd,
            config.num_stages)  # fmt: skip


def _make_plan(x, weight, bias, residual, store_rstd: bool, m: int, n: int, config: FwdConfig) -> _Plan:
    x_layout, r_layout = row_layout(x), (1, 0, 0)
    copy_x = x_layout is None
    if copy_x:
        x_layout = row_layout(x.contiguous())
    copy_r = False
    if residual is not None:
        r_layout = row_layout(residual)
        copy_r = r_layout is None
        if copy_r:
            r_layout = row_layout(residual.contiguous())
    consts = _fwd_consts(config, weight is not None, bias is not None, residual is not None, store_rstd)
    contiguous_w = weight is None or weight.is_contiguous()
    contiguous_b = bias is None or bias.is_contiguous()
    native = not store_rstd and eager_native(m, n, x, weight, bias, residual is not None)
    return _Plan(kernels().rms_norm_fwd_kernel, (config.programs,), consts, config.num_warps, copy_x, copy_r,
                 contiguous_w, contiguous_b, x_layout, r_layout, m, n, x.is_contiguous(), native, x.is_cuda)  # fmt: skip


def eager_native(m: int, n: int, x: torch.Tensor, weight, bias, fused: bool) -> bool:
    """Whether an eager forward of (m, n) rows takes the native ops (``DispatchConfig.native``)."""
    policy = CONFIG.native
    if policy == "never" or m == 0 or bias is not None or (weight is not None and weight.dtype != x.dtype):
        return False
    if policy == "always":
        return True
    from .crossover import native_forward_faster  # noqa: PLC0415

    return x.is_cuda and native_forward_faster(m, n, x.dtype, fused)


def backward_native(x: torch.Tensor, weight) -> bool:
    """Whether the backward of a kernel-path forward on ``x`` takes the native backward
    (``DispatchConfig.native``; the "table" rule reads ``crossover.BACKWARD``, CUDA only)."""
    policy = CONFIG.native
    if policy == "never" or (weight is not None and weight.dtype != x.dtype):
        return False
    if policy == "always":
        return True
    from .crossover import native_backward_faster  # noqa: PLC0415

    return x.is_cuda and native_backward_faster(x.shape[-1], x.dtype)


def native_now(plan: _Plan) -> bool:
    """Whether this call of ``plan`` takes the native ops: as planned, except while a CUDA graph is
    captured (replayed, the kernel's one launch costs less than the native ops')."""
    return plan.native and not (plan.cuda and torch.cuda.is_current_stream_capturing())


def _hooked(hook) -> bool:
    """Whether a launch hook is set: None, or an empty HookChain (newer triton), is none."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_launcher(compiled, grid: tuple[int], device: torch.device):
    """A launcher calling ``compiled``'s entry point directly: what ``compiled[grid]`` does per
    call minus its device query and hook look-ups (no launch hooks are installed). None where
    this triton's CompiledKernel differs, or launch hooks (a profiler) are set."""
    try:
        from triton import knobs  # noqa: PLC0415

        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            return None
        compiled._init_handles()
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        current_stream = torch._C._cuda_getCurrentRawStream
    except Exception:
        return None
    index, g0 = device.index if device.index is not None else torch.cuda.current_device(), grid[0]

    def launch(*args):
        run(g0, 1, 1, current_stream(index), function, packed, None, None, None, *args)

    return launch


def _launch(plan: _Plan, args: tuple) -> None:
    if plan.launcher is not None and CONFIG.fast_launch:
        try:
            plan.launcher(*args)
            return
        except Exception:  # the calling convention differs in this triton version: a slower launcher
            if plan.launcher is plan.direct:
                configure(direct_launch=False)
                plan.launcher = plan.direct = None
            else:
                configure(fast_launch=False)
    compiled = plan.kernel[plan.grid](*args, num_warps=plan.num_warps)
    if CONFIG.fast_launch and compiled is not None and hasattr(type(compiled), "__getitem__"):
        # a CompiledKernel (CUDA; the interpreter returns None)
        plan.direct = direct_launcher(compiled, plan.grid, args[0].device) if CONFIG.direct_launch else None
        plan.launcher = plan.direct or compiled[(plan.grid[0], 1, 1)]


def _tune(x, weight, bias, residual, store_rstd, m, n, outputs) -> int:
    """The fastest warps of the candidates for this call's (N, dtypes, flags), timed on it."""
    key = (x.device, x.dtype, n, None if weight is None else weight.dtype, None if bias is None else bias.dtype,
           residual is not None, store_rstd, CONFIG.design)  # fmt: skip
    if key in _TUNED:
        return _TUNED[key]
    base = fwd_config(m, n, x.device, element_size=x.element_size())
    best, best_ms = base.num_warps, float("inf")
    for warps in warp_candidates(base, x.element_size()):
        plan = _make_plan(x, weight, bias, residual, store_rstd, m, n,
                          fwd_config(m, n, x.device, num_warps=warps, element_size=x.element_size()))
        args = _fwd_args(plan, x, weight, bias, residual, *outputs)
        _launch(plan, args)  # compile and warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            _launch(plan, args)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) < best_ms:
            best, best_ms = warps, start.elapsed_time(end)
    _TUNED[key] = best
    return best


def _fwd_args(plan: _Plan, x, weight, bias, residual, y, s, rstd, eps: float = 0.0) -> tuple:
    """The kernel's arguments in parameter order (placeholders for absent tensors are never read)."""
    if plan.fixups:
        x = x.contiguous() if plan.copy_x else x
        residual = residual.contiguous() if plan.copy_r and residual is not None else residual
        weight = weight.contiguous() if weight is not None else None
        bias = bias.contiguous() if bias is not None else None
    return (x, x if residual is None else residual, y if weight is None else weight, y if bias is None else bias,
            y, y if s is None else s, y if rstd is None else rstd, *plan.head, eps, *plan.consts)  # fmt: skip


def run_eager(plan: _Plan, x, weight, bias, residual, tail: tuple):
    """One eager launch of ``plan``: y, or (y, s) with a residual. ``tail`` is ``plan.tail(eps)``,
    which a caller with a fixed eps computes once."""
    y = torch.empty_like(x) if plan.like_x else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = None if residual is None else torch.empty_like(y)
    if plan.m:
        if plan.fixups:
            args = _fwd_args(plan, x, weight, bias, residual, y, s, None, tail[len(plan.head)])
        else:
            args = (x, x if residual is None else residual, y if weight is None else weight,
                    y if bias is None else bias, y, y if s is None else s, y, *tail)  # fmt: skip
        _launch(plan, args)
    return y if s is None else (y, s)


def _tunable(x: torch.Tensor, m: int, n: int) -> bool:
    return (
        x.is_cuda and m * n >= TUNE_FROM_NUMEL and n <= max_fused_n(x.element_size())
        and not torch.cuda.is_current_stream_capturing()
    )  # fmt: skip


def _plan(x, weight, bias, residual, store_rstd: bool, key: tuple) -> _Plan:
    """A new launch plan for this call (warps tuned on it when large enough), cached under ``key``."""
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    warps = None
    if m and _tunable(x, m, n):
        outputs = (torch.empty_like(x), torch.empty_like(x) if residual is not None else None,
                   torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) if store_rstd else None)  # fmt: skip
        warps = _tune(x, weight, bias, residual, store_rstd, m, n, outputs)
    config = fwd_config(max(m, 1), max(n, 1), x.device, num_warps=warps, element_size=x.element_size())
    plan = _make_plan(x, weight, bias, residual, store_rstd, m, n, config)
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def forward_eager(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm``'s eager path without autograd: y, or (y, s) with a residual of x's shape and
    dtype. The host work of a repeated call is one dict look-up, its allocations and the launch."""
    plan = eager_plan(x, weight, bias, residual)
    if plan.native and native_now(plan):
        return forward_native(x, weight, residual, eps)
    return run_eager(plan, x, weight, bias, residual, plan.tail(eps))


def eager_plan(x, weight, bias, residual) -> _Plan:
    """The cached launch plan of an eager call (made and cached on the first call of its key)."""
    key = _plan_key(x, weight, bias, residual, False)
    return _PLANS.get(key) or _plan(x, weight, bias, residual, False, key)


def forward(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, store_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(y, s or None, rstd or None) through the kernels; residual, if given, matches x's shape."""
    key = _plan_key(x, weight, bias, residual, store_rstd)
    plan = _PLANS.get(key) or _plan(x, weight, bias, residual, store_rstd, key)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) if store_rstd else None
    if plan.m:
        _launch(plan, _fwd_args(plan, x, weight, bias, residual, y, s, rstd, eps))
    return y, s, rstd


# Bumped by ``clear_cache``: the eager plans cached per norm module (``rms_norm.module_rms_norm``)
# carry it in their keys, so clearing the launch plans invalidates them too.
generation = 0


def clear_cache() -> None:
    """Forget cached launch plans, tuned warps and the plans cached per norm module (after
    changing the module's constants)."""
    global generation
    _PLANS.clear()
    _TUNED.clear()
    generation += 1




# --------------------------------------------------------------------------- backward


def _bwd_warps(block_n: int, element_size: int) -> int:
    return max(4, min(16 if element_size <= 2 else 8, block_n // 256))


def bwd_programs(tiles: int, n: int, device: torch.device) -> int:
    """Backward grid: many programs at small N (8 per SM), about 1 per SM at 16K."""
    per_sm = max(1, min(8, 16384 // _next_pow2(n)))
    return min(tiles, multiprocessors(device) * per_sm)


def bwd_rows_per_program(m: int, n: int, device: torch.device) -> int:
    """Consecutive rows each backward program takes (a multiple of ``bwd_block_m``): the rows
    spread over ``bwd_programs`` programs, each then writing one row of dw partials."""
    block_m = bwd_block_m(n)
    programs = bwd_programs(_cdiv(m, block_m), n, device)
    return _cdiv(_cdiv(m, programs), block_m) * block_m


# short rows are packed to backward tiles of this many elements, so each step of a program's
# loop has several rows' loads in flight (one 768-element row is 1.5 KB)
BWD_MULTI_ROW_TILE = 4096


def bwd_block_m(n: int) -> int:
    """Rows per backward tile."""
    return max(1, BWD_MULTI_ROW_TILE // _next_pow2(n))


# column-parallel dw/db for long rows: a [DW_BLOCK_R, DW_BLOCK_C] tile per step
DW_BLOCK_R = 16
DW_BLOCK_C = 128
DW_WARPS = 8


def backward(
    dy: torch.Tensor, xs: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
    ds: torch.Tensor | None, has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dw, db) through the kernels: dw, db float32 sums over rows (db empty without a bias)."""
    n = xs.shape[-1]
    m = xs.numel() // n if n else 0
    dev = xs.device
    dx = torch.empty(xs.shape, dtype=xs.dtype, device=dev)
    if m == 0:
        zeros = torch.zeros(n, dtype=torch.float32, device=dev)
        return dx, zeros, zeros.clone() if has_bias else zeros.new_empty(0)
    xs, x_layout = _strided_rows(xs)
    dy, rstd = dy.contiguous(), rstd.contiguous()
    ds = ds.contiguous() if ds is not None else None
    k = kernels()
    w_arg = weight.contiguous() if weight is not None else dy
    ds_arg = ds if ds is not None else dy
    loop = n > max_fused_n(xs.element_size(), backward=True)
    if not loop:
        block_n, block_m = _next_pow2(n), bwd_block_m(n)
        rows_per_program = bwd_rows_per_program(m, n, dev)
        programs = _cdiv(m, rows_per_program)
        dw_part = torch.empty((programs, n), dtype=torch.float32, device=dev)
        db_part = torch.empty((programs, n), dtype=torch.float32, device=dev) if has_bias else dw_part
        k.rms_norm_bwd_rows_kernel[(programs,)](
            dy, xs, w_arg, rstd, ds_arg, dx, dw_part, db_part, m, n, *x_layout, rows_per_program,
            BLOCK_M=block_m, BLOCK_N=block_n, HAS_W=weight is not None, HAS_B=has_bias, HAS_DS=ds is not None,
            NUM_STAGES=NUM_STAGES, num_warps=_bwd_warps(block_m * block_n, xs.element_size()),
        )  # fmt: skip
        return dx, dw_part.sum(0), db_part.sum(0) if has_bias else dw_part.new_empty(0)
    k.rms_norm_bwd_kernel[(min(m, 2 * multiprocessors(dev)),)](
        dy, xs, w_arg, rstd, ds_arg, dx, m, n, *x_layout,
        BLOCK_N=LOOP_BLOCK_N, HAS_W=weight is not None, HAS_DS=ds is not None, NUM_STAGES=NUM_STAGES,
        num_warps=_bwd_warps(LOOP_BLOCK_N, xs.element_size()),
    )  # fmt: skip
    block_c = min(DW_BLOCK_C, _next_pow2(n))
    columns = _cdiv(n, block_c)
    splits = max(1, min(_cdiv(m, DW_BLOCK_R), _cdiv(2 * multiprocessors(dev), columns)))
    rows_per_split = _cdiv(_cdiv(m, splits), DW_BLOCK_R) * DW_BLOCK_R
    splits = _cdiv(m, rows_per_split)
    dw_part = torch.empty((splits, n), dtype=torch.float32, device=dev)
    db_part = torch.empty((splits, n), dtype=torch.float32, device=dev) if has_bias else dw_part
    k.rms_norm_bwd_dw_kernel[(columns, splits)](
        dy, xs, rstd, dw_part, db_part, m, n, *x_layout, rows_per_split,
        BLOCK_R=DW_BLOCK_R, BLOCK_C=block_c, HAS_B=has_bias, NUM_STAGES=NUM_STAGES, num_warps=DW_WARPS,
    )  # fmt: skip
    return dx, dw_part.sum(0), db_part.sum(0) if has_bias else dw_part.new_empty(0)


# --------------------------------------------------------------------------- AOT variants


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation as the launchers build it: for compiling without a GPU."""

    label: str
    kernel: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    aligned: tuple[str, ...] = ()  # arguments specialised as multiples of 16 (pointers: 16-byte aligned)


_FWD_CONST_NAMES = ("BLOCK_M", "TILE_A", "TILE_B", "LOOP", "HAS_W", "HAS_B", "HAS_R", "STORE_RSTD", "NUM_STAGES")
# what triton specialises as divisible by 16 on a model's contiguous, aligned tensors (N % 16 == 0;
# the inner row stride of a one-stride layout is 0)
_FWD_ALIGNED = ("X", "R", "W", "B", "Y", "S", "RSTD", "N", "sx_outer", "sx_inner", "sr_outer", "sr_inner")
_BWD_ALIGNED = ("DY", "X", "W", "RSTD", "DS", "DX", "DW_PART", "DB_PART", "N", "sx_outer", "sx_inner")
AOT_SHAPES = [(32768, 128), (32768, 768), (4096, 2048), (4096, 3072), (4096, 4096), (4096, 5120),
              (4096, 8192), (4096, 12288), (4096, 16384), (1, 65536)]  # fmt: skip


def bench_designs(n: int, element_size: int) -> list[str]:
    """The designs the benchmark times at row length ``n``: the table's choice first, then the
    alternatives that can hold such a row (reload from 4096 on, where it is a candidate)."""
    natural = fwd_design(n, element_size)
    others = [] if n > max_fused_n(element_size) else ["persistent", "row"] + (["reload"] if n >= 4096 else [])
    return [natural] + [d for d in others if d != natural]


def _fwd_signature(dtype: str, consts: dict) -> dict[str, str]:
    ptr = "*" + dtype
    sig = {name: ptr for name in ("X", "R", "W", "B", "Y", "S")}
    sig.update(RSTD="*fp32", M="i32", N="i32", x_inner="constexpr", sx_outer="i64", sx_inner="i32")
    sig.update(r_inner="constexpr", sr_outer="i32", sr_inner="i32", eps="fp32")
    sig.update({name: "constexpr" for name in consts})
    return sig


def _fwd_variants(dtype: str, m: int, n: int, design: str | None) -> Iterator[Variant]:
    size = 4 if dtype == "fp32" else 2
    with dispatch(design=design):
        config = fwd_config(m, n, torch.device("cpu"), element_size=size)
    for warps, has_r in itertools.product(warp_candidates(config, size), (False, True)):
        config = FwdConfig(**{**config.__dict__, "num_warps": warps})
        consts = dict(zip(_FWD_CONST_NAMES, _fwd_consts(config, True, True, has_r, True), strict=True))
        consts.update(x_inner=1, r_inner=1)
        label = f"fwd {config.design:<10} {dtype} M={m} N={n} residual={has_r} warps={warps}"
        yield Variant(label, kernels().rms_norm_fwd_kernel, _fwd_signature(dtype, consts), consts, warps,
                      _FWD_ALIGNED)  # fmt: skip


def aot_variants() -> Iterator[Variant]:
    """Every forward and backward specialisation the launchers use on a few model-like shapes, in
    all three pointer dtypes, the forward with each warp count it may tune to, and in bf16 each
    design the benchmark times (``python -m normswap.kernels.aot_check``)."""
    k = kernels()
    for dtype in ("bf16", "fp16", "fp32"):
        size = 4 if dtype == "fp32" else 2
        for m, n in AOT_SHAPES:
            designs = bench_designs(n, size) if dtype == "bf16" else [fwd_design(n, size)]
            for design in designs:
                yield from _fwd_variants(dtype, m, n, design)
        for n in (768, 4096, 8192, 16384, 65536):
            loop = n > max_fused_n(size, backward=True)
            block_n = LOOP_BLOCK_N if loop else _next_pow2(n)
            for has_w, has_ds in ((True, True), (False, False)):
                yield _bwd_variant(dtype, n, block_n, 1 if loop else bwd_block_m(n), loop, has_w, has_ds)
        for has_b in (False, True):
            consts = {"BLOCK_R": DW_BLOCK_R, "BLOCK_C": DW_BLOCK_C, "HAS_B": has_b, "NUM_STAGES": NUM_STAGES}
            ptr = "*" + dtype
            sig = {"DY": ptr, "X": ptr, "RSTD": "*fp32", "DW_PART": "*fp32", "DB_PART": "*fp32",
                   "M": "i32", "N": "i32", "x_inner": "i32", "sx_outer": "i32", "sx_inner": "i32",
                   "rows_per_split": "i32", **{c: "constexpr" for c in consts}}  # fmt: skip
            yield Variant(f"bwd_dw {dtype} HAS_B={has_b}", k.rms_norm_bwd_dw_kernel, sig, consts, DW_WARPS,
                          ("DY", "X", "RSTD", "DW_PART", "DB_PART", "N", "sx_outer", "sx_inner"))  # fmt: skip


def _bwd_variant(dtype, n, block_n, block_m, loop, has_w, has_ds) -> Variant:
    """The rows kernel (``loop`` False) or the long-row dx kernel, as ``backward`` launches them."""
    ptr = "*" + dtype
    sig = {"DY": ptr, "X": ptr, "W": ptr, "RSTD": "*fp32", "DS": ptr, "DX": ptr}
    if not loop:
        sig.update(DW_PART="*fp32", DB_PART="*fp32")
    sig.update(M="i32", N="i32", x_inner="i32", sx_outer="i32", sx_inner="i32")
    if loop:
        consts = {"BLOCK_N": block_n, "HAS_W": has_w, "HAS_DS": has_ds, "NUM_STAGES": NUM_STAGES}
    else:
        sig["rows_per_program"] = "i32"
        consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_W": has_w, "HAS_B": has_w, "HAS_DS": has_ds,
                  "NUM_STAGES": NUM_STAGES}  # fmt: skip
    sig.update({c: "constexpr" for c in consts})
    warps = _bwd_warps(block_m * block_n, 4 if dtype == "fp32" else 2)
    label = f"bwd {dtype} N={n} rows={block_m} loop={loop} affine={has_w} ds={has_ds} warps={warps}"
    kernel = kernels().rms_norm_bwd_kernel if loop else kernels().rms_norm_bwd_rows_kernel
    aligned = tuple(a for a in _BWD_ALIGNED if a in sig)
    return Variant(label, kernel, sig, consts, warps, aligned)
