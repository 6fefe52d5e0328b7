"""The forward designs chosen by row length, the host-side dispatch rule, and the compiled path.

Every design runs in Triton's CPU interpreter (or compiled on CUDA) against the float64 reference
of ``test_kernels``; shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import _SKIP, DEVICE, DTYPES, check, make

from normswap.kernels import rms_norm, set_compile_path
from normswap.kernels.ops import fallback, launch
from normswap.kernels.testing import interpreter_env

pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
DESIGNS = ["multirow", "persistent", "row", "reload"]


@pytest.fixture(autouse=True)
def interpreted_and_fresh():
    launch.clear_cache()
    if DEVICE == "cuda":
        yield
    else:
        with interpreter_env():
            yield
    launch.clear_cache()


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_every_design_against_float64(design, dtype, residual, monkeypatch):
    monkeypatch.setattr(launch, "MIN_PROGRAMS", 2)  # multirow packs rows even for 9 of them
    monkeypatch.setattr(launch, "LOOP_BLOCK_N", 256)  # reload: several chunks and a ragged tail
    with launch.forced_design(design):
        for n in (7, 769):
            config = launch.fwd_config(9, n, torch.device(DEVICE), element_size=dtype.itemsize)
            assert config.design == design
            check(*make((9, n), dtype, residual=residual))


@pytest.mark.parametrize(("n", "size", "design"), [
    (128, 2, "multirow"), (768, 2, "multirow"), (2048, 2, "multirow"), (4096, 2, "persistent"),
    (8192, 2, "persistent"), (12288, 2, "row"), (16384, 2, "row"), (16385, 2, "reload"), (65536, 2, "reload"),
    (1024, 4, "multirow"), (4096, 4, "persistent"), (8192, 4, "row"), (16384, 4, "reload"),
])  # fmt: skip
def test_dispatch_table_by_row_length(n, size, design):
    config = launch.fwd_config(32768, n, torch.device("cpu"), element_size=size)
    assert config.design == design
    if design in ("row", "reload"):  # one program per row
        assert config.programs == 32768 and config.block_m == 1
    else:  # a few programs per SM, looping over row tiles
        assert config.programs < 32768
    assert config.loop == (design == "reload")


def test_bench_designs_start_with_the_tables_choice():
    assert launch.bench_designs(768, 2) == ["multirow", "persistent", "row"]
    assert launch.bench_designs(16384, 2) == ["row", "persistent", "reload"]
    assert launch.bench_designs(65536, 2) == ["reload"]


def test_backward_packs_short_rows():
    assert [launch.bwd_block_m(n) for n in (768, 2048, 4096, 8192)] == [4, 2, 1, 1]


@pytest.mark.parametrize("residual", [False, True])
def test_small_calls_go_to_the_native_ops_below_the_threshold(residual, monkeypatch):
    monkeypatch.setattr(launch, "NATIVE_MAX_ROWS", 2)
    x, w, b, r = make((2, 64), torch.float32, residual=residual)
    got = rms_norm(x, w, b, 1e-5, residual=r)
    want = fallback.rms_norm_torch(x, w, b) if r is None else fallback.add_rms_norm_torch(x, r, w, b)
    (plan,) = launch._PLANS.values()
    assert plan.native
    for g, e in zip(got if r is not None else [got], want if r is not None else [want], strict=True):
        assert torch.equal(g, e)  # bitwise the torch composite
    check(*make((3, 64), torch.float32, residual=residual))  # 3 rows: the kernel
    assert sum(not p.native for p in launch._PLANS.values()) == 1


def test_compile_paths_trace_fullgraph_and_match_eager():
    x, w, b, r = make((2, 3, 40), torch.float32, residual=True)

    def step(x, r, w, b):
        y, s = rms_norm(x, w, b, 1e-5, residual=r)
        return torch.relu(y) * 2, s + 1

    want = step(x, r, w, b)
    try:
        for path in ("decompose", "kernel"):
            set_compile_path(path)
            torch._dynamo.reset()
            graphs = []
            compiled = torch.compile(step, fullgraph=True, backend=lambda gm, _, seen=graphs: seen.append(gm) or gm)
            got = compiled(x, r, w, b)
            for g, e in zip(got, want, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
            custom = any("normswap" in str(node.target) for node in graphs[0].graph.nodes)
            assert custom == (path == "kernel"), path
    finally:
        set_compile_path("decompose")
        torch._dynamo.reset()
    with pytest.raises(ValueError, match="compile path"):
        set_compile_path("triton")


class _FakeCompiled:
    """The parts of triton's CompiledKernel a direct launch uses."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def _init_handles(self):
        pass

    def run(self, *args):
        self.calls.append(args)

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("runner", grid, *args))


def test_direct_launcher_calls_the_entry_point_with_the_current_stream(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    compiled = _FakeCompiled()
    launcher = launch.direct_launcher(compiled, (7,), torch.device("cuda", 1))
    launcher("x", "y")
    assert compiled.calls == [(7, 1, 1, 1001, "function", "metadata", None, None, None, "x", "y")]
    other = type("OtherCompiled", (), {"_init_handles": lambda self: None, "run": None, "function": None})()
    assert launch.direct_launcher(other, (7,), torch.device("cuda", 1)) is None  # no packed_metadata


def test_a_refused_direct_launch_falls_back_to_tritons_launcher(monkeypatch):
    compiled = _FakeCompiled()

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, num_warps: compiled

    def refused(*args):
        raise TypeError("calling convention")

    monkeypatch.setattr(launch, "direct_launcher", lambda *a: None)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    plan = launch._Plan(Kernel(), (3,), (), 4, False, False, True, True, (1, 0, 0), (1, 0, 0))
    plan.launcher = plan.direct = refused
    launch._launch(plan, (torch.zeros(1),))
    assert launch.FAST_LAUNCH and not launch.DIRECT_LAUNCH
    assert plan.direct is None and plan.launcher is not None
    plan.launcher("a")
    assert compiled.calls == [("runner", (3, 1, 1), "a")]
