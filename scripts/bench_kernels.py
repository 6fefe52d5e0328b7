"""Benchmark normswap's RMSNorm kernels against their peers; JSON to benchmarks/results/.

    python scripts/bench_kernels.py            # CUDA: the full grid (fits in ~5 min on an H200)
    python scripts/bench_kernels.py --quick    # a few shapes, for checking the script
    python scripts/bench_kernels.py --cpu      # the CPU fallback and its alternatives (~1 min)

Achieved bandwidth counts the bytes an ideal kernel moves: x read and y written (plus residual
read and s written for the fused-add variant, plus weight/bias once). It is reported as GB/s, as
a % of a plain copy of the same number of bytes timed in the same run, and as a % of the device's
peak (from its memory clock and bus width where torch exposes them, else a table).

Each implementation's output is checked against a float64 reference before it is timed; a wrong
one is recorded with its error and not timed. On CUDA timing is ``triton.testing.do_bench``
(median, p20, p80 of the per-call time); on CPU a perf_counter loop with the same quantiles.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
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

from normswap.kernels import fallback, rms_norm  # noqa: E402
from normswap.modeling.remote import RMSNorm  # noqa: E402

EPS = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL_M = [1, 32, 512, 4096, 32768]
FULL_N = [768, 2048, 4096, 8192, 16384, 65536]
# peak HBM bandwidth by device name, when torch does not expose clock and bus width
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}

# --------------------------------------------------------------------------- implementations
# Each takes (x, w, b, r) and returns y (plain: r is None) or (y, s) (fused add: r given).
# Peers without a fused add run the add and then the norm, as a model would.


def _hf_eager(x, w):
    """Llama-style eager RMSNorm as transformers writes it (rounds before the weight)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def _exact_eager(x, w):
    """The rounding normswap uses (fp32 until one final rounding); the torch.compile subject."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _with_add(norm: Callable) -> Callable:
    def run(x, w, b, r):
        if r is None:
            return norm(x, w, b)
        s = x + r
        return norm(s, w, b), s

    return run


def _normswap(x, w, b, r):
    return rms_norm(x, w, None, EPS, residual=r)


def _normswap_bias(x, w, b, r):
    return rms_norm(x, w, b, EPS, residual=r)


def _add_exact_eager(x, r, w):
    s = x + r
    return _exact_eager(s, w), s


def _compiled() -> Callable:
    """torch.compile of the same math; M is dynamic (marked), N and dtype static (see run())."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)
    plain = torch.compile(_exact_eager, dynamic=False)
    add_norm = torch.compile(_add_exact_eager, dynamic=False)

    def run(x, w, b, r):
        torch._dynamo.maybe_mark_dynamic(x, 0)  # one compile per (N, dtype), not per M
        if r is None:
            return plain(x, w)
        torch._dynamo.maybe_mark_dynamic(r, 0)
        return add_norm(x, r, w)

    return run


def _liger() -> Callable | None:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
    except ImportError:
        return None

    def norm(x, w, b):
        # casting_mode "gemma" = fp32 throughout, the rounding closest to ours
        return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma")

    return _with_add(norm)


def cuda_impls() -> dict[str, Callable]:
    impls = {
        "normswap": _normswap,
        "normswap_unfused": _with_add(lambda x, w, b: rms_norm(x, w, None, EPS)),
        "normswap_bias": _normswap_bias,
        "hf_eager": _with_add(lambda x, w, b: _hf_eager(x, w)),
        "F.rms_norm": _with_add(lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, EPS)),
        "torch.compile": _compiled(),
        "layer_norm": _with_add(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)),
    }
    liger = _liger()
    if liger is not None:
        impls["liger"] = liger
    return impls


def _remote_forward(x, w, b):
    """normswap.modeling.remote.RMSNorm.forward itself, without nn.Module call overhead."""
    return RMSNorm.forward(types.SimpleNamespace(weight=w, bias=b, eps=EPS), x)


def _cpu_inplace_manual(x, w, b):
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(EPS))
    return y.mul_(w.float()).add_(b.float()).to(x.dtype)


def cpu_impls() -> dict[str, Callable]:
    """The CPU fallback as used, and the options it was chosen from (all with weight and bias)."""
    return {
        "normswap": _normswap_bias,
        "remote_forward": _with_add(_remote_forward),
        "F.rms_norm+bias": _with_add(
            lambda x, w, b: (F.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS) + b.float()).to(x.dtype)
        ),
        "inplace_manual": _with_add(_cpu_inplace_manual),
        "layer_norm": _with_add(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, EPS)),
    }


# --------------------------------------------------------------------------- measurement


def reference(x, w, b, r, *, bias: bool):
    s = x if r is None else x + r  # torch's add rounds like the kernels do
    s64 = s.double()
    y = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    return y + b.double() if bias else y


CHECK_ROWS = 128  # first and last rows checked against float64 (all would need ~8x the input)


def _ends(t: torch.Tensor) -> torch.Tensor:
    """The first and last CHECK_ROWS rows: the last ones sit past 2**31 elements in the largest
    shapes, where 32-bit offsets would go wrong."""
    return t if t.shape[0] <= 2 * CHECK_ROWS else torch.cat([t[:CHECK_ROWS], t[-CHECK_ROWS:]])


def max_error(impl: str, out, x, w, b, r, *, bias: bool) -> float:
    """max |y - y64| / max |y64| over the first and last CHECK_ROWS rows."""
    y = _ends(out[0] if r is not None else out)
    if impl == "layer_norm":  # a different function: only check it ran and is finite
        return 0.0 if bool(torch.isfinite(y).all()) else math.inf
    want = reference(_ends(x), w, b, None if r is None else _ends(r), bias=bias)
    return float((y.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def time_cuda(fn: Callable, quick: bool) -> tuple[float, float, float]:
    from triton.testing import do_bench  # noqa: PLC0415

    reps = (5, 20) if quick else (10, 40)
    median, p20, p80 = do_bench(fn, warmup=reps[0], rep=reps[1], quantiles=[0.5, 0.2, 0.8])
    return median, p20, p80


def time_cpu(fn: Callable, quick: bool) -> tuple[float, float, float]:
    fn()
    samples = []
    budget = 0.02 if quick else 0.15
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(samples, n=10)
    return statistics.median(samples), q[1], q[7]


def peak_gbps() -> float | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return next((gbps for name, gbps in PEAK_GBPS.items() if name in props.name), None)


def ideal_bytes(m: int, n: int, elt: int, fused: bool) -> int:
    return (4 if fused else 2) * m * n * elt + 2 * n * elt


BIASED = {"normswap_bias", "layer_norm"}  # CUDA peers are compared weight-only, like Liger's


def bench_shape(impls, m, n, dtype, fused, device, timer, quick, copy_ms, biased=BIASED):
    g = torch.Generator(device=device).manual_seed(m * 131 + n)

    def randn(*shape):  # generated in place on the device: 2**31-element inputs stay fast
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    x = randn(m, n)
    r = randn(m, n) if fused else None
    w = 1 + 0.1 * randn(n)
    b = 0.1 * randn(n)
    nbytes = ideal_bytes(m, n, x.element_size(), fused)
    rows = []
    for name, impl in impls.items():
        row = {"impl": name, "M": m, "N": n, "dtype": str(dtype).removeprefix("torch."),
               "variant": "fused_add" if fused else "plain", "bytes": nbytes}  # fmt: skip
        try:
            err = max_error(name, impl(x, w, b, r), x, w, b, r, bias=name in biased)
        except Exception as exc:  # a peer that cannot run this shape (Liger past 64K, OOM...)
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        row["max_rel_err"] = err
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        if not err <= tolerance:
            rows.append({**row, "error": "incorrect output: not timed"})
            continue
        median, p20, p80 = timer(lambda impl=impl: impl(x, w, b, r), quick)
        gbps = nbytes / (median * 1e-3) / 1e9
        rows.append({**row, "ms_median": median, "ms_p20": p20, "ms_p80": p80, "GBps": gbps,
                     "pct_of_copy": 100 * copy_ms / median})  # fmt: skip
    return rows


def bench_copy(m, n, dtype, fused, device, timer, quick) -> float:
    """Median ms of one copy moving the same bytes as the op (reads + writes)."""
    numel = (2 if fused else 1) * m * n + n
    src = torch.empty(numel, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src), quick)[0]


def grid(args, on_cuda: bool) -> tuple[list[int], list[int], list[str]]:
    """(Ms, Ns, dtypes), most important first: the time budget may cut the tail."""
    if args.quick:  # odd N past MAX_FUSED_N: the looped kernel path
        return ([512, 1], [768, 65536 + 3], ["bf16", "fp32"]) if on_cuda else ([64, 1], [768, 4099], ["fp32"])
    if on_cuda:
        return sorted(FULL_M, reverse=True), FULL_N, ["bf16", "fp16", "fp32"]
    return [4096, 512, 32, 1], [768, 2048], ["fp32", "bf16"]


def run(args, out: Path) -> dict:
    on_cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if on_cuda else "cpu"
    if not on_cuda:
        torch.set_num_threads(args.threads)
    timer = time_cuda if on_cuda else time_cpu
    impls = cuda_impls() if on_cuda else cpu_impls()
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    ms, ns, dtypes = grid(args, on_cuda)
    peak = peak_gbps() if on_cuda else None
    report = {"meta": meta(args, on_cuda, peak), "results": []}
    started = time.time()
    for dname in dtypes:
        for n in ns:
            torch._dynamo.reset()  # torch.compile: fresh graphs per (N, dtype), dynamic in M
            for m in ms:
                for fused in (False, True):
                    if time.time() - started > args.budget_s:
                        report["meta"]["truncated"] = f"time budget of {args.budget_s} s reached"
                        return finish(report, out, started)
                    copy_ms = bench_copy(m, n, DTYPES[dname], fused, device, timer, args.quick)
                    rows = bench_shape(impls, m, n, DTYPES[dname], fused, device, timer, args.quick, copy_ms,
                                       biased=BIASED if on_cuda else set(impls))  # fmt: skip
                    for row in rows:
                        row["copy_ms"] = copy_ms
                        if peak and "GBps" in row:
                            row["pct_of_peak"] = 100 * row["GBps"] / peak
                    report["results"].extend(rows)
                    print_rows(rows)
            finish(report, out, started)  # partial results survive a kill
    return finish(report, out, started)


def meta(args, on_cuda: bool, peak: float | None) -> dict:
    return {
        "script": "scripts/bench_kernels.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if on_cuda else platform.processor() or platform.machine(),
        "cpu_threads": None if on_cuda else torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "liger_kernel": _version("liger_kernel"),
        "peak_GBps": peak,
        "mode": "quick" if args.quick else "full",
        "eps": EPS,
        "bytes": "ideal traffic: x read + y written (+ residual read + s written when fused) + params",
        "fallback_small_numel": fallback.SMALL_NUMEL,
    }


def finish(report: dict, out: Path, started: float) -> dict:
    report["meta"]["seconds"] = round(time.time() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


def print_rows(rows) -> None:
    for row in rows:
        shape = f"{row['dtype']:>8} {row['variant']:>9} M={row['M']:<6} N={row['N']:<6}"
        if "error" in row:
            print(f"{shape} {row['impl']:<17} {row['error']}", flush=True)
        else:
            print(f"{shape} {row['impl']:<17} {row['ms_median'] * 1e3:10.1f} us {row['GBps']:8.1f} GB/s "
                  f"{row['pct_of_copy']:6.1f}% of copy", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes and short timings")
    parser.add_argument("--cpu", action="store_true", help="benchmark the CPU path even if CUDA exists")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: steadier)")
    parser.add_argument("--impls", help="comma-separated subset of implementations")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/bench_kernels-<device>.json)")
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available() and not args.cpu
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"bench_kernels-{'cuda' if on_cuda else 'cpu'}{'-quick' if args.quick else ''}.json"
    )
    report = run(args, out)
    print(f"wrote {out} ({report['meta']['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
