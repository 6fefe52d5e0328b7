"""Compile every kernel variant for a GPU without having one: ``python -m normswap.kernels.aot_check``.

The interpreter checks what the kernels compute but not that they compile. Triton ships its own
PTX assembler, so ``triton.compile`` can build cubins for a target architecture on a CPU-only
machine; this module does so for the configurations ``rms_norm`` launches and prints each one's
register and stack (spill) use, read back with the bundled ``cuobjdump``. Exit status 1 if any
variant fails to compile.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile

from .ops import rms_norm as op

POINTER_DTYPES = ("bf16", "fp16", "fp32")


def _fwd_signature(dtype: str, inner_is_one: bool) -> dict[str, str]:
    ptr = "*" + dtype
    inner = "constexpr" if inner_is_one else "i32"
    sig = {name: ptr for name in ("X", "R", "W", "B", "Y", "S")}
    sig.update(RSTD="*fp32", M="i32", N="i32", x_inner=inner, sx_outer="i64", sx_inner="i32")
    sig.update(r_inner=inner, sr_outer="i32", sr_inner="i32", eps="fp32")
    sig.update({name: "constexpr" for name in ("BLOCK_M", "BLOCK_N", "LOOP", "HAS_W", "HAS_B", "HAS_R", "STORE_RSTD")})
    return sig


def _bwd_signature(dtype: str) -> dict[str, str]:
    ptr = "*" + dtype
    sig = {"DY": ptr, "X": ptr, "W": ptr, "RSTD": "*fp32", "DS": ptr, "DX": ptr}
    sig.update(DW_PART="*fp32", DB_PART="*fp32", M="i32", N="i64", x_inner="i32", sx_outer="i32")
    sig.update(sx_inner="i32", rows_per_program="i32", BLOCK_N="constexpr", LOOP="constexpr")
    sig.update(HAS_W="constexpr", HAS_DS="constexpr")
    return sig


def _resources(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    fields = next((line.split() for line in out.splitlines() if "REG:" in line), [])
    return " ".join(field for field in fields if field.split(":")[0] in ("REG", "STACK", "SHARED"))


def _variants(shapes):
    for dtype, (m, n), residual in itertools.product(POINTER_DTYPES, shapes, (False, True)):
        block_m, block_n, loop, warps = op._fwd_config(m, n)
        yield ("fwd", dtype, m, n, residual, warps,
               {"x_inner": 1, "r_inner": 1, "BLOCK_M": block_m, "BLOCK_N": block_n, "LOOP": loop,
                "HAS_W": True, "HAS_B": True, "HAS_R": residual, "STORE_RSTD": True})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90: H100/H200)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # must compile, not interpret
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    kernels = op._kernels()
    target = GPUTarget("cuda", args.arch, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    shapes = [(32768, 128), (32768, 768), (4096, 2048), (4096, 4096), (4096, 8192), (4096, 16384), (1, 65536)]
    failures = 0
    jobs = list(_variants(shapes))
    for dtype, loop in itertools.product(POINTER_DTYPES, (False, True)):
        for has_w, has_ds in ((True, True), (False, False)):
            consts = {"BLOCK_N": 4096 if loop else 1024, "LOOP": loop, "HAS_W": has_w, "HAS_DS": has_ds}
            jobs.append(("bwd", dtype, 0, 0, has_ds, max(8, min(32, consts["BLOCK_N"] // 128)), consts))
    for kind, dtype, m, n, residual, warps, consts in jobs:
        fn = kernels.rms_norm_fwd_kernel if kind == "fwd" else kernels.rms_norm_bwd_kernel
        sig = _fwd_signature(dtype, True) if kind == "fwd" else _bwd_signature(dtype)
        label = f"{kind} {dtype} M={m} N={n} residual={residual} warps={warps} {consts}"
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": warps})
        except Exception as exc:  # report every failing variant, not just the first
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {exc}", flush=True)
            continue
        usage = _resources(compiled.asm["cubin"], cuobjdump) if os.path.exists(cuobjdump) else ""
        print(f"ok   {label} {usage}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
