"""Compile every kernel variant for a GPU without having one: ``python -m normswap.kernels.aot_check``.

The interpreter checks what the kernels compute but not that they compile. Triton ships its own
PTX assembler, so ``triton.compile`` can build for a target architecture on a CPU-only machine;
this module does so for every specialisation the launchers use (``launch.aot_variants``: both
designs by row length, three dtypes, model-like shapes, pointers specialised as 16-byte aligned
as on a model's tensors) and reports each one's registers, spill bytes and shared memory, read
from the bundled ``ptxas -v`` on the generated PTX, and its widest global load and store. Exit status 1 if any
variant fails to compile or spills registers to local memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

from .ops import launch

_PTXAS_FIELDS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "smem": re.compile(r"(\d+) bytes smem"),
}


def ptxas_usage(ptx: str, arch: int, ptxas: str) -> dict[str, int]:
    """Registers, spill bytes, stack frame and static shared memory of one PTX kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", path,
                              "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True)  # fmt: skip
    text = out.stdout + out.stderr
    if out.returncode:
        raise RuntimeError(text.strip().splitlines()[-1] if text.strip() else "ptxas failed")
    return {name: int(m.group(1)) if (m := rx.search(text)) else 0 for name, rx in _PTXAS_FIELDS.items()}


def _ptxas(arch: int) -> str:
    """The ptxas that triton itself uses for ``arch`` (the bundled one may come in two ages)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415

        return get_ptxas(arch).path
    except (ImportError, AttributeError, TypeError):
        import triton  # noqa: PLC0415

        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-zA-Z0-9_:]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
# pipelined loads (num_stages > 1) copy global to shared memory asynchronously: cp.async ..., BYTES
_ASYNC = re.compile(r"\bcp\.async\.\w+\.shared\.global\S*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-fA-F]+|\d+)")


def access_bits(ptx: str) -> dict[str, int]:
    """The widest global load and store in ``ptx``, in bits (128: 16-byte vectors)."""
    widest = {"load_bits": 0, "store_bits": 0}
    for op, vec, bits in _ACCESS.findall(ptx):
        key = "load_bits" if op == "ld" else "store_bits"
        widest[key] = max(widest[key], int(vec or 1) * int(bits))
    for size in _ASYNC.findall(ptx):
        widest["load_bits"] = max(widest["load_bits"], 8 * int(size, 0))
    return widest


_VARIANTS: list = []


def _compile(index_and_arch: tuple[int, int]) -> dict:
    """Compile variant ``index`` for ``arch``: its report row (run in a forked worker)."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    index, arch = index_and_arch
    variant = _VARIANTS[index]
    row = {"variant": variant.label, "num_warps": variant.num_warps}
    try:
        names = variant.kernel.arg_names
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in variant.aligned}
        src = ASTSource(variant.kernel, variant.signature, constexprs=variant.constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": variant.num_warps})
        row.update(ptxas_usage(compiled.asm["ptx"], arch, _ptxas(arch)))
        row.update(access_bits(compiled.asm["ptx"]))
    except Exception as exc:  # report every failing variant, not just the first
        row["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90: H100/H200)")
    parser.add_argument("--json", help="also write the report to this JSON file (rewritten after every variant)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--limit", type=int, help="compile only every k-th variant, about this many (a quick check)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # must compile, not interpret
    import triton  # noqa: PLC0415

    _VARIANTS[:] = launch.aot_variants()
    step = max(1, len(_VARIANTS) // args.limit) if args.limit else 1
    jobs = [(i, args.arch) for i in range(0, len(_VARIANTS), step)]
    report: list[dict] = []

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"arch": args.arch, "triton": triton.__version__, "variants_total": len(jobs),
                           "variants": report}, f, indent=1)  # fmt: skip

    failures = 0
    pool = multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    try:
        for row in pool.imap(_compile, jobs) if pool else map(_compile, jobs):
            report.append(row)
            failures += _print_row(row)
            save()
    finally:
        if pool:
            pool.terminate()
    print(f"{len(report)} variants, {failures} failing or spilling")
    return 1 if failures else 0


def _print_row(row: dict) -> bool:
    """Print one report row; whether it failed or spilled."""
    if "error" in row:
        print(f"FAIL {row['variant']}: {row['error']}", flush=True)
        return True
    spills = row["spill_stores"] + row["spill_loads"]
    print(f"{'SPILL' if spills else 'ok   '} {row['variant']:<76} regs {row['registers']:>3} "
          f"spill {spills:>4} B  smem {row['smem']:>6} B  ld/st {row['load_bits']}/{row['store_bits']} bit",
          flush=True)  # fmt: skip
    return spills > 0


if __name__ == "__main__":
    sys.exit(main())
