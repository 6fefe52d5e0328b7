"""Triton RMSNorm kernels against a float64 reference that rounds where the kernels round.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
set for this module only), in float32 and float16 (the interpreter has no bfloat16 math); with
CUDA they run compiled, bfloat16 included. Shapes stay small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from normswap.kernels import HAS_TRITON, rms_norm, use_kernels
from normswap.kernels.ops import launch
from normswap.kernels.testing import interpreter_env, interpreter_unavailable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_SKIP = (None if HAS_TRITON else "triton is not installed") if DEVICE == "cuda" else interpreter_unavailable()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# ulp-scale tolerances of the final rounding, plus float32 statistics error
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3},
}


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    """Interpret the kernels on CPU for this module only."""
    if DEVICE == "cuda":
        yield
        return
    with interpreter_env():
        yield


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    """Each test starts with no cached launch plans (some change the launcher's constants)."""
    launch.clear_cache()
    yield
    launch.clear_cache()


def reference(x, weight=None, bias=None, eps=1e-5, residual=None):
    """float64 RMSNorm rounding where the kernel does: s in x.dtype, y once at the end."""
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    s64 = s.double()
    y = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype), s


def make(shape, dtype, *, weight=True, bias=True, residual=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]

    def rand(*size):
        return torch.randn(*size, generator=g).to(dtype).to(DEVICE)

    return (
        rand(*shape),
        rand(n) if weight else None,
        rand(n) if bias else None,
        rand(*shape) if residual else None,
    )


def check(x, weight, bias, residual, eps=1e-5):
    assert use_kernels(x)
    out = rms_norm(x, weight, bias, eps, residual=residual)
    y_ref, s_ref = reference(x, weight, bias, eps, residual)
    if residual is None:
        y = out
    else:
        y, s = out
        assert torch.equal(s, s_ref)  # the add is rounded exactly as torch's unfused add
        assert s.shape == x.shape
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, y_ref, **TOL[x.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 769, 1023, 5120])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("residual", [False, True])
def test_forward_against_float64(dtype, n, affine, residual):
    check(*make((3, n), dtype, weight=affine[0], bias=affine[1], residual=residual))


@pytest.mark.parametrize("residual", [False, True])
def test_long_rows_take_the_looped_path(residual):
    n = 131072 + 3  # beyond Liger's and flash-attention's 64K limit; odd tail chunk
    assert launch.fwd_config(2, n, torch.device(DEVICE)).loop
    check(*make((2, n), torch.float32, residual=residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_looped_path_with_many_chunks(monkeypatch, dtype, residual):
    monkeypatch.setattr(launch, "MAX_FUSED_N", 128)
    monkeypatch.setattr(launch, "LOOP_BLOCK_N", 128)
    check(*make((3, 1023), dtype, residual=residual))


def test_multi_row_path(monkeypatch):
    monkeypatch.setattr(launch, "MIN_PROGRAMS", 1)
    m, n = 37, 16  # per-head-norm-like: short rows, packed 32 to a program, last tile ragged
    assert launch.fwd_config(m, n, torch.device(DEVICE)).block_m == 32
    check(*make((m, n), torch.float32, residual=True))
    check(*make((m, n), torch.float16))


@pytest.mark.parametrize("residual", [False, True])
def test_sliced_inputs_need_no_copy(residual):
    base, w, b, r_base = make((3, 6, 100), torch.float32, residual=True)
    views = [
        (base[:, 1:4, :77], r_base[:, 2:5, 10:87]),  # 3-D, two row strides
        (base.view(18, 100)[::3, 5:69], r_base.view(18, 100)[1::3, :64]),  # 2-D, row stride 300
        (base[0, :, :50], r_base[2, :, 50:]),
    ]
    for x, r in views:
        assert launch.row_layout(x) is not None and launch.row_layout(r) is not None
        n = x.shape[-1]
        check(x, w[:n].contiguous(), b[:n].contiguous(), r if residual else None)
        out = rms_norm(x, w[:n], b[:n], residual=r if residual else None)
        expected = rms_norm(x.contiguous(), w[:n], b[:n], residual=r.contiguous() if residual else None)
        for got, want in zip(out if residual else [out], expected if residual else [expected], strict=True):
            if DEVICE == "cpu":  # the interpreter reduces every row alike
                assert torch.equal(got, want)
            else:  # a GPU may reduce an unaligned view in another order: last-bit differences
                torch.testing.assert_close(got, want)


def test_unmergeable_layout_is_copied_correctly():
    x = torch.randn(4, 3, 5, 32).to(DEVICE)[:, ::2, 1:4]  # three unmergeable row strides
    assert launch.row_layout(x) is None
    check(x, None, None, None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (1, 64), (64,), (1, 1, 1)])
@pytest.mark.parametrize("residual", [False, True])
def test_empty_and_single_rows(shape, residual):
    x, w, b, r = make(shape, torch.float32, residual=residual)
    out = rms_norm(x, w, b, residual=r)
    y = out[0] if residual else out
    assert y.shape == x.shape
    if x.numel():
        check(x, w, b, r)


def test_eps_is_a_runtime_argument():
    x, w, b, _ = make((2, 64), torch.float32)
    x = x * 1e-3  # mean(x**2) ~ 1e-6, so eps matters
    for eps in (1e-5, 1e-6, 1e-3):
        check(x, w, b, None, eps=eps)


def test_mixed_weight_dtype():
    x, _, _, r = make((3, 40), torch.float16, residual=True)
    w, b = torch.randn(40).to(DEVICE), torch.randn(40).to(DEVICE)
    check(x, w, b, r)


def _grads(x, weight, bias, residual, fn):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias, residual) if t is not None]
    it = iter(leaves)
    args = [next(it) if t is not None else None for t in (x, weight, bias, residual)]
    out = fn(*args)
    g = torch.Generator().manual_seed(1)
    y, s = (out, None) if residual is None else out
    loss = (y.double() * torch.randn(y.shape, generator=g).to(y.device, torch.float64)).sum()
    if s is not None:
        loss = loss + (s.double() * torch.randn(s.shape, generator=g).to(s.device, torch.float64)).sum()
    loss.backward()
    return [t.grad for t in leaves]


def _float64_fn(x, weight, bias, residual):
    s = x.double() if residual is None else x.double() + residual.double()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = y * weight.double() if weight is not None else y
    y = y + bias.double() if bias is not None else y
    return y if residual is None else (y, s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 769])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("looped", [False, True])
def test_backward_against_float64(monkeypatch, dtype, n, affine, residual, looped):
    if looped:
        monkeypatch.setattr(launch, "MAX_FUSED_N", 4)
        monkeypatch.setattr(launch, "LOOP_BLOCK_N", 256)
    # 9 rows over the interpreter's 4 backward programs: uneven rows per program
    tensors = make((9, n), dtype, weight=affine[0], bias=affine[1], residual=residual)
    got = _grads(*tensors, lambda x, w, b, r: rms_norm(x, w, b, 1e-5, residual=r))
    want = _grads(*(t.double() if t is not None else None for t in tensors), _float64_fn)
    # the upstream gradient reaches the kernel rounded to dtype (2**-9 relative in bfloat16), and
    # dw, db sum 9 such products: in bfloat16 a near-cancelling sum can be off by ~0.02 absolute
    tol = {
        torch.float32: {"rtol": 1e-4, "atol": 1e-4},
        torch.float16: {"rtol": 2e-2, "atol": 2e-2},
        torch.bfloat16: {"rtol": 4e-2, "atol": 5e-2},
    }[dtype]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **tol)


def test_backward_of_sliced_input():
    base, w, b, _ = make((4, 80), torch.float32)
    x = base[:, 3:67]
    got = _grads(x, w[:64].contiguous(), None, None, lambda x, w, b, r: rms_norm(x, w))
    want = _grads(x.double(), w[:64].double(), None, None, _float64_fn)
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_custom_op_registration():
    x, w, b, r = make((2, 3, 40), torch.float32, residual=True)
    w.requires_grad_()
    torch.library.opcheck(torch.ops.normswap.rms_norm_fwd, (x, w, b, r, 1e-5))
    torch.library.opcheck(torch.ops.normswap.rms_norm_fwd, (x, None, None, None, 1e-5))


@pytest.mark.slow
def test_torch_compile_fullgraph():
    x, w, b, r = make((2, 3, 40), torch.float32, residual=True)

    def step(x, r, w, b):
        y, s = rms_norm(x, w, b, 1e-5, residual=r)
        return torch.relu(y) * 2, s + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [compiled(xs[0], r, w, b), step(xs[1], r, w, b)]
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want)
    for i in range(2):
        (outs[i][0].sum() + outs[i][1].sum()).backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad)


def test_column_parallel_dw_over_several_row_splits(monkeypatch):
    monkeypatch.setattr(launch, "MAX_FUSED_N", 4)
    monkeypatch.setattr(launch, "LOOP_BLOCK_N", 64)
    monkeypatch.setattr(launch, "DW_BLOCK_R", 4)
    monkeypatch.setattr(launch, "DW_BLOCK_C", 32)
    tensors = make((40, 100), torch.float32, residual=True)  # 4 column blocks, 5 row splits
    got = _grads(*tensors, lambda x, w, b, r: rms_norm(x, w, b, 1e-5, residual=r))
    want = _grads(*(t.double() for t in tensors), _float64_fn)
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [768, 3072, 5120, 6144, 12288])
def test_rows_split_into_two_power_of_two_tiles(n):
    config = launch.fwd_config(4096, n, torch.device(DEVICE), element_size=2)
    assert config.tile_a + config.tile_b == n and config.tile_a & (config.tile_a - 1) == 0
    assert config.tile_b & (config.tile_b - 1) == 0


def test_repeated_calls_reuse_one_launch_plan():
    x, w, b, r = make((4, 96), torch.float32, residual=True)
    first = rms_norm(x, w, b, residual=r)
    plans = len(launch._PLANS)
    for _ in range(3):
        again = rms_norm(x, w, b, residual=r)
        for got, want in zip(again, first, strict=True):
            assert torch.equal(got, want)
    assert len(launch._PLANS) == plans
    if DEVICE == "cuda":  # the compiled kernel's launcher is cached and used
        assert launch.CONFIG.fast_launch
        assert all(plan.launcher is not None for plan in launch._PLANS.values())


def test_pointer_alignment_is_part_of_the_plan():
    base, w, b, _ = make((5, 65), torch.float16)
    aligned, shifted = base[:, :64], base[:, 1:]  # same shape and strides, shifted by 2 bytes
    check(aligned, w[:64].contiguous(), b[:64].contiguous(), None)
    check(shifted, w[:64].contiguous(), b[:64].contiguous(), None)
    assert len(launch._PLANS) == 2


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launch, "MAX_PLANS", 2)
    for rows in (1, 2, 3):
        check(*make((rows, 32), torch.float32))
        assert len(launch._PLANS) <= 2


def _norm_module(n: int, dtype: torch.dtype, eps: float = 1e-5) -> torch.nn.Module:
    from normswap.modeling.remote import RMSNorm

    norm = RMSNorm(n, eps=eps).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(2))
        norm.bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    return norm.to(dtype)


def _module_plans(norm) -> dict:
    from normswap.kernels.ops import rms_norm as rms_norm_mod

    return norm.__dict__.get(rms_norm_mod._EAGER_PLANS, {})


@pytest.mark.parametrize("residual", [False, True])
def test_module_plan_hit_equals_miss_and_is_invalidated(residual):
    """A norm module's cached eager plan computes what its first call computed; clear_cache, a
    new dtype, shape or eps each make a new plan, with results of the new arguments."""
    from normswap.kernels.ops.rms_norm import module_rms_norm

    norm = _norm_module(40, torch.float32)
    x, _, _, r = make((3, 40), torch.float32, residual=residual)

    def call(norm, x, r):
        out = module_rms_norm(norm, x, r)
        y_ref, s_ref = reference(x, norm.weight, norm.bias, norm.eps, r)
        y = out[0] if r is not None else out
        torch.testing.assert_close(y, y_ref, **TOL[x.dtype])
        return out

    with torch.no_grad():
        first = call(norm, x, r)
        (plan,) = _module_plans(norm).values()
        for _ in range(2):
            again = call(norm, x, r)
            for got, want in zip(again if r is not None else [again], first if r is not None else [first], strict=True):
                assert torch.equal(got, want)
        assert list(_module_plans(norm).values()) == [plan]
        launch.clear_cache()
        call(norm, x, r)
        assert len(_module_plans(norm)) == 2
        call(norm, x[:2].contiguous(), None if r is None else r[:2].contiguous())  # a shape
        assert len(_module_plans(norm)) == 3
        norm.eps = 1e-1  # an eps: the plan's arguments carry it
        call(norm, x, r)
        assert len(_module_plans(norm)) == 4
        half = norm.to(torch.float16)  # a dtype (the same module, parameters converted in place)
        call(half, x.half(), None if r is None else r.half())
        assert len(_module_plans(norm)) == 5


def test_module_plans_are_bounded_and_rechecked(monkeypatch):
    from normswap.kernels.ops import rms_norm as rms_norm_mod

    monkeypatch.setattr(rms_norm_mod, "MAX_MODULE_PLANS", 2)
    norm = _norm_module(16, torch.float32)
    with torch.no_grad():
        for rows in (1, 2, 3):
            rms_norm_mod.module_rms_norm(norm, make((rows, 16), torch.float32)[0])
            assert len(_module_plans(norm)) <= 2
        norm.weight = torch.nn.Parameter(torch.ones(5))  # a new weight: a new key, checked again
        with pytest.raises(ValueError, match="weight must have shape"):
            rms_norm_mod.module_rms_norm(norm, make((1, 16), torch.float32)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_rows_backward_blocks_of_rows_against_float64(monkeypatch, dtype, residual):
    """The row-per-program backward: 37 rows, 2 a step, 6 a program over 7 programs (the last
    with one row), so dw and db partials come from ragged steps and a ragged last program."""
    monkeypatch.setattr(launch, "BWD_MULTI_ROW_TILE", 64)
    monkeypatch.setattr(launch, "multiprocessors", lambda device: 1)
    assert launch.bwd_block_m(24) == 2 and launch.bwd_rows_per_program(37, 24, torch.device(DEVICE)) == 6
    tensors = make((37, 24), dtype, residual=residual)
    got = _grads(*tensors, lambda x, w, b, r: rms_norm(x, w, b, 1e-5, residual=r))
    want = _grads(*(t.double() if t is not None else None for t in tensors), _float64_fn)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    for g, ref in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), ref, **tol)


def test_native_backward_when_dispatched():
    """native="always": the backward runs the native formula on the saved rstd (on CUDA the
    kernel F.rms_norm's autograd runs), gradients as the float64 reference's."""
    tensors = make((5, 48), torch.float32, residual=True)
    with launch.dispatch(native="always"):
        got = _grads(*tensors, lambda x, w, b, r: rms_norm(x, w, b, 1e-5, residual=r))
    want = _grads(*(t.double() for t in tensors), _float64_fn)
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), ref, rtol=1e-4, atol=1e-4)
