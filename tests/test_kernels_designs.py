"""The forward designs chosen by row length, the host-side dispatch rule, and the compiled path.

Every design runs in Triton's CPU interpreter (or compiled on CUDA) against the float64 reference
of ``test_kernels``; shapes stay tiny.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels import _SKIP, DEVICE, DTYPES, check, make

from normswap.kernels import rms_norm, set_compile_path
from normswap.kernels.ops import crossover, fallback, launch
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
    with launch.dispatch(design=design):
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
def test_native_policy_always_takes_f_rms_norm_for_bias_free_calls(residual):
    from normswap.kernels.ops.rms_norm import module_rms_norm
    from normswap.modeling.remote import RMSNorm

    x, w, _, r = make((2, 64), torch.float32, residual=residual)
    with launch.dispatch(native="always"):
        got = rms_norm(x, w, None, 1e-5, residual=r)
        (plan,) = launch._PLANS.values()
        assert plan.native
        want = fallback.forward_native(x, w, r, 1e-5)
        for g, e in zip(got if r is not None else [got], want if r is not None else [want], strict=True):
            assert torch.equal(g, e)  # bitwise the native ops
        check(*make((3, 64), torch.float32, residual=residual))  # a bias: the kernel
        assert sum(not p.native for p in launch._PLANS.values()) == 1
        norm = RMSNorm(64, bias=False).to(DEVICE)
        with torch.no_grad():
            out = module_rms_norm(norm, x, r)
        want = fallback.forward_native(x, norm.weight, r, 1e-5)
        assert torch.equal(out if r is None else out[0], want if r is None else want[0])
    launch.clear_cache()
    with launch.dispatch(native="table"):  # measured on CUDA only: CPU calls take the kernel
        rms_norm(x, w, None, 1e-5, residual=r)
        assert DEVICE == "cuda" or not any(p.native for p in launch._PLANS.values())


def test_eager_native_follows_the_crossover_table():
    cuda = torch.empty(0, dtype=torch.bfloat16, device="meta")
    with launch.dispatch(native="table"):
        # meta tensors stand in for CUDA ones: the rule reads x.is_cuda
        assert not launch.eager_native(1, 768, cuda, None, None, False)
    assert crossover.native_forward_faster(1, 768, torch.bfloat16, False)
    assert crossover.native_forward_faster(32, 768, torch.bfloat16, True)
    assert crossover.native_forward_faster(20, 1000, torch.float16, False)  # fp16 borrows bf16's rows
    assert not crossover.native_forward_faster(8, 2048, torch.bfloat16, True)  # measured slower there
    assert not crossover.native_forward_faster(33, 768, torch.bfloat16, False)  # beyond the measured M
    assert not crossover.native_forward_faster(1, 8192, torch.bfloat16, False)  # beyond the measured N
    assert not crossover.native_forward_faster(1, 768, torch.float32, False)  # not measured
    assert crossover.native_backward_faster(768, torch.bfloat16)
    assert not crossover.native_backward_faster(16384, torch.bfloat16)
    assert not crossover.native_backward_faster(1 << 20, torch.bfloat16)


def test_eager_native_rule(monkeypatch):
    x = torch.empty(4, 768, dtype=torch.bfloat16)
    w, b = torch.empty(768, dtype=torch.bfloat16), torch.empty(768, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    with launch.dispatch(native="table"):
        assert launch.eager_native(4, 768, x, w, None, False)
        assert not launch.eager_native(4, 768, x, w, b, False)  # a bias: the kernel
        assert not launch.eager_native(4, 768, x, w.float(), None, False)  # a weight of another dtype
        assert not launch.eager_native(4096, 768, x, w, None, False)  # large M: the kernel
        assert not launch.eager_native(0, 768, x, w, None, False)
    with launch.dispatch(native="never"):
        assert not launch.eager_native(4, 768, x, w, None, False)


def test_crossover_tables_are_derived_from_their_source():
    import json
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / crossover.SOURCE
    assert crossover.derive(json.loads(source.read_text())["results"]) == (crossover.FORWARD, crossover.BACKWARD)


def test_dispatch_config_is_one_frozen_object():
    before = launch.dispatch_config()
    generation = launch.generation
    with launch.dispatch(design="row", native="never") as config:
        assert launch.dispatch_config() is config and config.design == "row" and config.native == "never"
        assert launch.generation > generation
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.design = "multirow"
    assert launch.dispatch_config() == before
    for bad in ({"design": "tiled"}, {"native": "sometimes"}, {"compile_path": "triton"}):
        with pytest.raises(ValueError):
            launch.DispatchConfig(**bad)


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
    monkeypatch.setattr(launch, "CONFIG", launch.DispatchConfig())
    plan = launch._Plan(Kernel(), (3,), (), 4, False, False, True, True, (1, 0, 0), (1, 0, 0))
    plan.launcher = plan.direct = refused
    launch._launch(plan, (torch.zeros(1),))
    assert launch.CONFIG.fast_launch and not launch.CONFIG.direct_launch
    assert plan.direct is None and plan.launcher is not None
    plan.launcher("a")
    assert compiled.calls == [("runner", (3, 1, 1), "a")]
