"""Benchmark normswap's RMSNorm kernels against their peers; JSON to benchmarks/results/.

    python scripts/bench_kernels.py --out benchmarks/results/gpu/bench_kernels-cuda.json
                                                    # CUDA: every section, bf16 first (~3 min on an H200)
    python scripts/bench_kernels.py --quick         # CUDA: a few shapes, for checking the script
    python scripts/bench_kernels.py --cpu           # CPU: the fallback and its alternatives, then the host time
    python scripts/bench_kernels.py --host          # CPU: host time per eager call only, launch stubbed (~20 s)
    python scripts/bench_kernels.py --dry-run --out out/bench_kernels-dry-run.json
                                                    # the CUDA sections in the Triton interpreter, tiny shapes

JSON is written only where ``--out`` says.

Sections (CUDA), each implementation's output checked against float64 before it is timed:

* ``forward``: y = RMSNorm(x) ("plain") and (y, s) with s = x + r ("fused_add"), bf16 at
  M = 32768 (``forward4096``: M = 4096; ``fp16``: fp16), N from 768 to 65536. ``normswap`` is the
  dispatch table's choice; ``normswap[design]`` forces each design that can hold the row
  (``launch.bench_designs``), so one run shows which design wins at each N. Bandwidth counts the bytes an ideal kernel moves (x read and y written,
  plus r read and s written when fused, plus the weight), as GB/s and as a % of a device copy of
  the same bytes timed in the same run. Peers: the add-then-norm through normswap's kernel
  (``normswap_unfused``), Liger-Kernel (its fused add+norm kernel for fused_add),
  ``torch.compile`` (at most two compiles per (N, dtype)), ``F.rms_norm``.
* ``backward``: the gradients of x and the weight for a given dy, timed alone (the forward's
  graph is kept); the same peers.
* ``decode``: M = 1-32. ``wall_us`` is the host wall time per call in a loop of calls (what a
  decode step pays when it is launch-bound); ``graph_us`` is the device time per call replayed
  from a CUDA graph. ``normswap`` runs with ``native="never"`` here, so its row is the Triton
  launch's and ``F.rms_norm`` the native ops' that ``launch.DispatchConfig(native="table")``
  picks between (``normswap.kernels.ops.crossover`` derives its table from these rows);
  ``normswap_dispatched`` is the call as dispatched by the table in force; ``torch_composite``
  the exact torch fallback.
* ``host_overhead`` (``--host``, CPU): host time per eager call with the launch stubbed, against
  ``F.layer_norm`` and ``F.rms_norm``.
* ``large``: a bf16 input of more than 2**31 elements, its last rows checked (32-bit offsets).

Timing: ``triton.testing.do_bench`` medians with p20/p80. ``--budget-s`` is a hard limit: a
watchdog stops the run there and the JSON keeps what was measured, marked truncated.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from normswap.kernels import rms_norm  # noqa: E402
from normswap.kernels.ops import fallback, launch  # noqa: E402
from normswap.modeling.remote import RMSNorm  # noqa: E402

EPS = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FWD_N = [768, 2048, 4096, 5120, 8192, 16384, 65536]
FWD_M = [32768, 4096]
BWD_N = [768, 2048, 4096, 8192, 16384, 65536]
BWD_M = 16384
DECODE_M = [1, 8, 32]
DECODE_N = [768, 2048, 4096]
LARGE = (262400, 8192)  # 2.15e9 elements: past 2**31
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}


class BudgetExceeded(Exception):
    pass


# --------------------------------------------------------------------------- implementations
# Each takes (x, w, r) and returns y (r None) or (y, s) (r given).


def _normswap(x, w, r):
    return rms_norm(x, w, None, EPS, residual=r)


def _normswap_unfused(x, w, r):
    """The add, then the norm: what the fused kernel saves one pass over memory against."""
    if r is None:
        return rms_norm(x, w, None, EPS)
    s = x + r
    return rms_norm(s, w, None, EPS), s


def _exact_eager(x, w):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _add_exact_eager(x, r, w):
    s = x + r
    return _exact_eager(s, w), s


def _compiled() -> Callable:
    """torch.compile of the same math with automatic dynamic shapes: a second M recompiles once
    with M symbolic, after which no M recompiles (at most two compiles per (N, dtype))."""
    plain = torch.compile(_exact_eager)
    add_norm = torch.compile(_add_exact_eager)

    def run(x, w, r):
        return plain(x, w) if r is None else add_norm(x, r, w)

    return run


def _f_rms_norm(x, w, r):
    if r is None:
        return F.rms_norm(x, (x.shape[-1],), w, EPS)
    s = x + r
    return F.rms_norm(s, (s.shape[-1],), w, EPS), s


def _liger() -> Callable | None:
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction  # noqa: PLC0415
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
    except ImportError:
        return None

    def run(x, w, r):
        # casting_mode "gemma": fp32 throughout, the rounding closest to normswap's
        if r is None:
            return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)
        return LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "gemma", False)

    return run


def _normswap_dispatched(x, w, r):
    """normswap as dispatched by the crossover table (the native ops where they were measured
    faster); the other ``normswap`` rows run with ``native="never"``, the Triton path alone."""
    with launch.dispatch(native="table"):
        return rms_norm(x, w, None, EPS, residual=r)


def _normswap_design(design: str) -> Callable:
    """normswap with every forward forced to ``design`` (the dispatch table's alternatives)."""

    def run(x, w, r):
        with launch.dispatch(design=design):
            return rms_norm(x, w, None, EPS, residual=r)

    return run


def _torch_composite(x, w, r):
    """The exact torch composite (several native ops; the CPU fallback)."""
    if r is None:
        return fallback.rms_norm_torch(x, w, None, EPS)
    return fallback.add_rms_norm_torch(x, r, w, None, EPS)


def cuda_impls(device: str) -> dict[str, Callable]:
    impls = {
        "normswap": _normswap,
        "normswap_unfused": _normswap_unfused,
        "torch.compile": _compiled(),
        "F.rms_norm": _f_rms_norm,
    }
    liger = _liger() if device == "cuda" else None
    if liger is not None:
        impls["liger"] = liger
    return impls


# --------------------------------------------------------------------------- checks and timers


def reference(x, w, r) -> torch.Tensor:
    s = (x if r is None else x + r).double()  # torch's add rounds as the kernels do
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


CHECK_ROWS = 128


def _ends(t: torch.Tensor) -> torch.Tensor:
    """First and last CHECK_ROWS rows: in the large section the last sit past 2**31 elements."""
    return t if t.shape[0] <= 2 * CHECK_ROWS else torch.cat([t[:CHECK_ROWS], t[-CHECK_ROWS:]])


def max_error(out, x, w, r) -> float:
    """max |y - y64| / max |y64| over the first and last rows."""
    y = _ends(out[0] if r is not None else out)
    want = reference(_ends(x), w, None if r is None else _ends(r))
    return float((y.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def time_cuda(fn: Callable, quick: bool) -> tuple[float, float, float]:
    from triton.testing import do_bench  # noqa: PLC0415

    warmup, rep = (3, 10) if quick else (5, 25)
    median, p20, p80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
    return median, p20, p80


def time_cpu(fn: Callable, quick: bool) -> tuple[float, float, float]:
    fn()
    samples, budget = [], 0.02 if quick else 0.15
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(samples, n=10)
    return statistics.median(samples), q[1], q[7]


def peak_gbps() -> float | None:
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return next((gbps for name, gbps in PEAK_GBPS.items() if name in props.name), None)


def randn(shape, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def inputs(m, n, dtype, device, fused):
    x = randn((m, n), dtype, device, m * 131 + n)
    r = randn((m, n), dtype, device, m * 137 + n) if fused else None
    w = 1 + 0.1 * randn((n,), dtype, device, n)
    return x, w, r


def copy_ms(numel: int, dtype, device, timer, quick) -> float:
    src = torch.empty(numel, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src), quick)[0]


# --------------------------------------------------------------------------- sections


class Run:
    """Shared state of one benchmark run: report, deadline, output file."""

    def __init__(self, args, out: Path | None):
        self.args, self.out = args, out
        self.device = "cpu" if args.cpu or args.dry_run else "cuda"
        self.timer = time_cuda if self.device == "cuda" else time_cpu
        self.started = time.time()
        self.report = {"meta": meta(args), "results": []}

    def check_time(self) -> None:
        if time.time() - self.started > self.args.budget_s:
            raise BudgetExceeded

    def add(self, rows: list[dict]) -> None:
        self.report["results"].extend(rows)
        for row in rows:
            print(format_row(row), flush=True)
        self.save()

    def save(self) -> None:
        self.report["meta"]["seconds"] = round(time.time() - self.started, 1)
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=1) + "\n")


def bench_forward(run: Run, impls: dict, dtypes: list[str], ms: list[int], ns: list[int]) -> None:
    peak = run.report["meta"]["peak_GBps"]
    for dname in dtypes:
        dtype = DTYPES[dname]
        for n in ns:
            torch._dynamo.reset()  # torch.compile: fresh graphs per (N, dtype), dynamic in M
            for m in ms:
                for fused in (False, True):
                    run.check_time()
                    x, w, r = inputs(m, n, dtype, run.device, fused)
                    nbytes = (4 if fused else 2) * m * n * x.element_size() + n * w.element_size()
                    ref_ms = copy_ms(nbytes // (2 * x.element_size()), dtype, run.device, run.timer, run.args.quick)
                    rows = []
                    designs = {f"normswap[{d}]": _normswap_design(d) for d in launch.bench_designs(n, x.element_size())}
                    for name, impl in {**impls, **designs}.items():
                        if name == "normswap_unfused" and not fused:
                            continue
                        run.check_time()
                        row = {"section": "forward", "impl": name, "M": m, "N": n, "dtype": dname,
                               "variant": "fused_add" if fused else "plain", "bytes": nbytes, "copy_ms": ref_ms}  # fmt: skip
                        rows.append(measure(row, functools.partial(impl, x, w, r), x, w, r, run))
                        if "ms_median" in rows[-1]:
                            rows[-1]["GBps"] = nbytes / (rows[-1]["ms_median"] * 1e-3) / 1e9
                            rows[-1]["pct_of_copy"] = 100 * ref_ms / rows[-1]["ms_median"]
                            if peak:
                                rows[-1]["pct_of_peak"] = 100 * rows[-1]["GBps"] / peak
                    run.add(rows)
                    del x, w, r


def measure(row: dict, call: Callable, x, w, r, run: Run) -> dict:
    try:
        err = max_error(call(), x, w, r)
    except Exception as exc:  # a peer that cannot run this shape (Liger past 64K, OOM...)
        return {**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    row["max_rel_err"] = err
    if not err <= tolerance(x.dtype):
        return {**row, "error": "incorrect output: not timed"}
    try:
        median, p20, p80 = run.timer(call, run.args.quick)
    except Exception as exc:
        return {**row, "error": f"timing: {type(exc).__name__}: {str(exc)[:200]}"}
    return {**row, "ms_median": median, "ms_p20": p20, "ms_p80": p80}


def bench_backward(run: Run, impls: dict, ns: list[int], m: int, dtype: torch.dtype = torch.bfloat16) -> None:
    dname = next(k for k, v in DTYPES.items() if v == dtype)
    for n in ns:
        torch._dynamo.reset()
        run.check_time()
        x0, w0, _ = inputs(m, n, dtype, run.device, False)
        dy = randn((m, n), dtype, run.device, 7)
        want = None
        rows = []
        for name, impl in impls.items():
            if name == "normswap_unfused":
                continue
            run.check_time()
            row = {"section": "backward", "impl": name, "M": m, "N": n, "dtype": dname, "variant": "plain",
                   "bytes": 3 * m * n * x0.element_size()}  # fmt: skip
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            try:
                y = impl(x, w, None)
                dx, dw = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
                if want is None:
                    want = _float64_grads(x0, w0, dy)
                err = max(_rel(dx, want[0]), _rel(dw, want[1]))
            except Exception as exc:
                rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            row["max_rel_err"] = err
            if not err <= 5e-2:  # dw sums M bf16-rounded products
                rows.append({**row, "error": "incorrect gradients: not timed"})
                continue
            try:
                median, p20, p80 = run.timer(functools.partial(torch.autograd.grad, y, (x, w), dy, retain_graph=True),
                                             run.args.quick)  # fmt: skip
            except Exception as exc:
                rows.append({**row, "error": f"timing: {type(exc).__name__}: {str(exc)[:200]}"})
                continue
            rows.append({**row, "ms_median": median, "ms_p20": p20, "ms_p80": p80,
                         "GBps": row["bytes"] / (median * 1e-3) / 1e9})  # fmt: skip
            del y
        run.add(rows)


def _float64_grads(x, w, dy):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * wd
    return torch.autograd.grad(y, (xd, wd), dy.double())


def _rel(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def bench_decode(run: Run, impls: dict, ms: list[int], ns: list[int], calls: int = 200,
                 dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    dname = next(k for k, v in DTYPES.items() if v == dtype)
    for n in ns:
        for m in ms:
            for fused in (False, True):
                run.check_time()
                x, w, r = inputs(m, n, dtype, run.device, fused)
                rows = []
                for name, impl in {**impls, "torch_composite": _torch_composite}.items():
                    if name == "normswap_unfused" and not fused:
                        continue
                    run.check_time()
                    row = {"section": "decode", "impl": name, "M": m, "N": n, "dtype": dname,
                           "variant": "fused_add" if fused else "plain"}  # fmt: skip
                    try:
                        if max_error(impl(x, w, r), x, w, r) > tolerance(dtype):
                            rows.append({**row, "error": "incorrect output: not timed"})
                            continue
                        row["wall_us"] = _wall_us(functools.partial(impl, x, w, r), calls, run.device)
                    except Exception as exc:
                        rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                        continue
                    if run.device == "cuda":
                        try:
                            row["graph_us"] = _graph_us(functools.partial(impl, x, w, r), calls)
                        except Exception as exc:  # e.g. a peer that cannot be captured
                            row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    rows.append(row)
                run.add(rows)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wall_us(call: Callable, calls: int, device: str) -> float:
    """Median over 5 rounds of the host wall time per call, ``calls`` calls a round."""
    for _ in range(10):
        call()
    _sync(device)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def _graph_us(call: Callable, calls: int) -> float:
    """Device time per call, ``calls`` calls captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def bench_large(run: Run, shape: tuple[int, int] = LARGE, dtype: torch.dtype = torch.bfloat16) -> None:
    m, n = shape
    dname = next(k for k, v in DTYPES.items() if v == dtype)
    for fused in (False, True):
        run.check_time()
        x, w, r = inputs(m, n, dtype, run.device, fused)
        nbytes = (4 if fused else 2) * m * n * x.element_size()
        row = {"section": "large", "impl": "normswap", "M": m, "N": n, "dtype": dname,
               "variant": "fused_add" if fused else "plain", "elements": m * n, "bytes": nbytes}  # fmt: skip
        out = _normswap(x, w, r)
        row["end_rows_max_rel_err"] = max_error(out, x, w, r)
        del out
        if row["end_rows_max_rel_err"] <= tolerance(dtype):
            median, p20, p80 = run.timer(functools.partial(_normswap, x, w, r), True)
            row.update(ms_median=median, ms_p20=p20, ms_p80=p80, GBps=nbytes / (median * 1e-3) / 1e9)
        else:
            row["error"] = "incorrect end rows: not timed"
        run.add([row])
        del x, w, r
        if run.device == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- CPU


def _remote_forward(x, w, b):
    """normswap.modeling.remote.RMSNorm.forward itself, without nn.Module call overhead."""
    return RMSNorm.forward(types.SimpleNamespace(weight=w, bias=b, eps=EPS), x)


def _cpu_inplace_manual(x, w, b):
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(EPS))
    return y.mul_(w.float()).add_(b.float()).to(x.dtype)


def bench_cpu(run: Run) -> None:
    """The fallback as used, against the options it was chosen from (weight and bias)."""
    impls = {
        "normswap": lambda x, w, b: rms_norm(x, w, b, EPS),
        "remote_forward": _remote_forward,
        "F.rms_norm+bias": lambda x, w, b: (F.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS) + b.float()).to(x.dtype),
        "inplace_manual": _cpu_inplace_manual,
        "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS),
    }
    ms, ns = ([64, 1], [768]) if run.args.quick else ([4096, 512, 32, 1], [768, 2048])
    for dname in ("fp32", "bf16"):
        for n in ns:
            for m in ms:
                run.check_time()
                x, w, _ = inputs(m, n, DTYPES[dname], "cpu", False)
                b = 0.1 * randn((n,), DTYPES[dname], "cpu", 3)
                rows = []
                for name, impl in impls.items():
                    median, p20, p80 = time_cpu(functools.partial(impl, x, w, b), run.args.quick)
                    rows.append({"section": "cpu_fallback", "impl": name, "M": m, "N": n, "dtype": dname,
                                 "variant": "plain", "ms_median": median, "ms_p20": p20, "ms_p80": p80})  # fmt: skip
                run.add(rows)
    bench_host_overhead(run)


HOST_SHAPES = ((1, 768), (32, 768), (1, 2048), (32, 2048))


def bench_host_overhead(run: Run) -> None:
    """Host time per eager call on CPU, normswap's op with its launch stubbed against the native
    ops it replaces or competes with.

    ``normswap`` is the kernel path of a repeated call (cached plan) with the Triton launch
    replaced by a no-op: what remains is normswap's Python (plan look-up, allocations, argument
    packing); on CUDA the launch adds the driver call, as every native op's launch does.
    ``normswap_unplanned`` rebuilds the plan each call. ``F.layer_norm`` (what the original
    model runs; one native op) and ``F.rms_norm`` run on CPU tensors this small, so their figures
    include a few hundred nanoseconds of compute; with a residual the add is a second native op
    for them. ``empty_like`` is the floor: one native op that allocates and computes nothing.
    """
    real_launch, real_use = launch._launch, rms_norm.__globals__["use_kernels"]
    shapes = HOST_SHAPES[:2] if run.args.quick else HOST_SHAPES
    for m, n in shapes:
        for fused in (False, True):
            run.check_time()
            x, w, r = inputs(m, n, torch.bfloat16, "cpu", fused)
            b = 0.1 * randn((n,), torch.bfloat16, "cpu", 3)
            timings = {}
            try:
                launch._launch = lambda plan, args: None
                rms_norm.__globals__["use_kernels"] = lambda t: True
                launch.clear_cache()
                call = functools.partial(rms_norm, x, w, b, EPS, residual=r)
                timings["normswap"] = _host_us(call, quick=run.args.quick)
                timings["normswap_unplanned"] = _host_us(lambda call=call: (launch.clear_cache(), call()),
                                                         quick=run.args.quick)  # fmt: skip
            finally:
                launch._launch, rms_norm.__globals__["use_kernels"] = real_launch, real_use
                launch.clear_cache()
            timings.update(_native_host_us(x, w, b, r, run.args.quick))
            rows = [{"section": "host_overhead", "impl": name, "M": m, "N": n, "dtype": "bf16",
                     "variant": "fused_add" if fused else "plain", "host_us": us,
                     "vs_F.layer_norm": us / timings["F.layer_norm"]} for name, us in timings.items()]  # fmt: skip
            run.add(rows)


def _native_host_us(x, w, b, r, quick: bool) -> dict[str, float]:
    """Host time per call of the native ops (with the residual add first when ``r`` is given)."""
    n = x.shape[-1]

    def add(t):
        return t if r is None else t + r

    return {
        "F.layer_norm": _host_us(lambda: F.layer_norm(add(x), (n,), w, b, EPS), quick=quick),
        "F.rms_norm": _host_us(lambda: F.rms_norm(add(x), (n,), w, EPS), quick=quick),
        "empty_like": _host_us(lambda: torch.empty_like(x), quick=quick),
    }


def _host_us(call: Callable, calls: int = 2000, quick: bool = False) -> float:
    calls = 50 if quick else calls
    for _ in range(50):
        call()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


# --------------------------------------------------------------------------- report


def meta(args) -> dict:
    on_cuda = not args.cpu and not args.dry_run
    return {
        "script": "scripts/bench_kernels.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if on_cuda else platform.processor() or platform.machine(),
        "cpu_threads": None if on_cuda else torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "liger_kernel": _version("liger_kernel"),
        "peak_GBps": peak_gbps() if on_cuda else None,
        "mode": "dry-run" if args.dry_run else "host" if args.host else "quick" if args.quick else "full",
        "budget_s": args.budget_s,
        "eps": EPS,
        "bytes": "ideal traffic: x read + y written (+ residual read + s written when fused) + weight",
        "fallback_small_numel": fallback.SMALL_NUMEL,
    }


def _version(module: str) -> str | None:
    try:
        import importlib.metadata  # noqa: PLC0415

        return importlib.metadata.version(module.replace("_", "-"))
    except Exception:
        return None


def format_row(row: dict) -> str:
    head = f"{row['section']:<13} {row['dtype']:>4} {row['variant']:>9} M={row['M']:<6} N={row['N']:<6} {row['impl']:<20}"
    if "error" in row:
        return f"{head} {row['error']}"
    if "host_us" in row:
        return f"{head} {row['host_us']:8.2f} us host  x{row['vs_F.layer_norm']:.2f} F.layer_norm's"
    if "wall_us" in row:
        graph = f"{row['graph_us']:8.2f} us graph" if "graph_us" in row else row.get("graph_error", "")
        return f"{head} {row['wall_us']:8.2f} us wall {graph}"
    extra = f" {row['GBps']:8.1f} GB/s" if "GBps" in row else ""
    extra += f" {row['pct_of_copy']:6.1f}% of copy" if "pct_of_copy" in row else ""
    return f"{head} {row['ms_median'] * 1e3:10.1f} us{extra}"


def summarise(results: list[dict]) -> dict:
    """Ratios the targets are stated in, from rows measured side by side."""
    by = {(r["section"], r["impl"], r["M"], r["N"], r["dtype"], r["variant"]): r for r in results if "ms_median" in r}
    out = {}
    for (section, impl, m, n, dtype, variant), row in by.items():
        if section != "forward" or impl != "normswap":
            continue
        key = f"{dtype} {variant} M={m} N={n}"
        for peer in ("liger", "torch.compile", "F.rms_norm", "normswap_unfused"):
            other = by.get((section, peer, m, n, dtype, variant))
            if other:
                out.setdefault(key, {})[f"speedup_vs_{peer}"] = other["ms_median"] / row["ms_median"]
        out.setdefault(key, {})["pct_of_copy"] = row.get("pct_of_copy")
    return out


def sections(args) -> list[tuple[str, Callable[[Run], None]]]:
    """(name, function of the run) in the order they run: bf16 first, other dtypes last."""
    if args.dry_run:  # every CUDA section, on shapes the interpreter runs in seconds
        impls = cuda_impls("cpu")
        dispatched = {**impls, "normswap_dispatched": _normswap_dispatched}
        return [
            ("forward", lambda run: bench_forward(run, impls, ["fp32"], [2], [96, 16384 + 5])),
            ("backward", lambda run: bench_backward(run, dispatched, [96, 8192 + 5], 2, torch.float32)),
            ("decode", lambda run: bench_decode(run, dispatched, [1], [96], calls=3, dtype=torch.float32)),
            ("large", lambda run: bench_large(run, (8, 64), torch.float32)),
        ]
    impls = cuda_impls("cuda")
    dispatched = {**impls, "normswap_dispatched": _normswap_dispatched}
    wanted, quick = args.sections.split(","), args.quick
    chosen = [
        ("forward", lambda run: bench_forward(run, impls, ["bf16"], [4096] if quick else [FWD_M[0]],
                                              [768, 65536 + 3] if quick else FWD_N)),
        ("backward", lambda run: bench_backward(run, dispatched, [768, 16384] if quick else BWD_N,
                                                4096 if quick else BWD_M)),
        ("decode", lambda run: bench_decode(run, dispatched, [1, 32] if quick else DECODE_M,
                                            [768] if quick else DECODE_N)),
        ("forward4096", lambda run: None if quick else bench_forward(run, impls, ["bf16"], FWD_M[1:], FWD_N)),
        ("large", lambda run: None if quick else bench_large(run)),
        ("fp16", lambda run: None if quick else bench_forward(run, impls, ["fp16"], FWD_M, FWD_N)),
    ]  # fmt: skip
    return [(name, fn) for name, fn in chosen if name in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes and short timings")
    parser.add_argument("--cpu", action="store_true", help="benchmark the CPU path even if CUDA exists")
    parser.add_argument("--host", action="store_true",
                        help="only the host time per eager call, launch stubbed, against F.layer_norm and F.rms_norm")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the CUDA sections on the CPU in the Triton interpreter, tiny shapes (checks the script)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: steadier)")
    parser.add_argument("--sections", default="forward,backward,decode,large,forward4096,fp16",
                        help="CUDA sections to run, in this order")
    parser.add_argument("--budget-s", type=float, default=240.0, help="hard time limit of the whole run")
    parser.add_argument("--out", type=Path, help="write the JSON here (e.g. benchmarks/results/bench_kernels-host.json); "
                                                 "without it the figures are only printed")  # fmt: skip
    args = parser.parse_args(argv)
    if args.host:
        args.cpu = True
    if not args.cpu and not args.dry_run and not torch.cuda.is_available():
        args.cpu = True
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    if args.cpu:
        torch.set_num_threads(args.threads)
    run = Run(args, args.out)
    launch.configure(native="never")  # "normswap" rows time the kernels; normswap_dispatched the table's choice

    def on_alarm(*_):
        raise BudgetExceeded

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, math.ceil(args.budget_s + 15)))  # a hard stop even inside one measurement
    try:
        if args.host:
            bench_host_overhead(run)
        elif args.cpu:
            bench_cpu(run)
        else:
            for name, section in sections(args):
                try:
                    section(run)
                except BudgetExceeded:
                    raise
                except Exception as exc:  # keep the other sections' figures
                    run.report["meta"].setdefault("section_errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
                    print(f"section {name} failed: {type(exc).__name__}: {exc}", flush=True)
    except BudgetExceeded:
        run.report["meta"]["truncated"] = f"time budget of {args.budget_s} s reached"
        print(f"stopped: time budget of {args.budget_s} s reached", flush=True)
    finally:
        signal.alarm(0)
    run.report["summary"] = summarise(run.report["results"])
    run.save()
    print(f"wrote {args.out} ({run.report['meta']['seconds']} s)" if args.out else
          f"done ({run.report['meta']['seconds']} s; --out to keep the JSON)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
