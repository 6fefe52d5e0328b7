"""Benchmark streaming conversion against `cp`: wall time, peak RSS and verification time by size.

Builds synthetic sharded GPT-2 checkpoints with random weights in real shapes (GPT-2-small,
GPT-2-medium ≈ 0.4B, GPT-2-XL ≈ 1.5B; fp16), then for each size, in the same run:

* ``cp`` of the same weight files (read plus write of the same bytes: the floor), twice;
* ``normswap inspect`` (start-up: importing torch and transformers, building the model class on
  meta, planning; no weights read or written), so the fixed cost can be told from the streaming;
* ``normswap convert --verify none`` (conversion alone): wall time and peak RSS;
* ``normswap verify`` in its automatic mode (whole models when small, layer by layer above
  1 GiB of float32 weights): wall time and peak RSS;
* ``normswap convert --verify auto`` (conversion plus verification in one process): wall time and
  peak RSS, and whether its weights hash the same as the first conversion's (determinism).

Every step runs in a fresh process under ``/usr/bin/time`` (peak RSS = its max resident set
size), after a ``sync`` so no step pays for the previous one's write-back. Results are printed as
a table with the ratios and the scaling with size, and written to
``benchmarks/results/bench_convert.json``. The synthetic checkpoints are deleted afterwards.

    python scripts/bench_convert.py                      # all sizes
    python scripts/bench_convert.py --sizes gpt2-small   # quick check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_convert.json"


@dataclass(frozen=True)
class Size:
    """A GPT-2 shape and how many shards its checkpoint is split into."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    shards: int
    vocab: int = 50257
    positions: int = 1024


SIZES = {
    "gpt2-small": Size("gpt2-small", 12, 768, 12, shards=1),
    "gpt2-medium": Size("gpt2-medium", 24, 1024, 16, shards=2),
    "gpt2-xl": Size("gpt2-xl", 48, 1600, 25, shards=4),
}


# ---------------------------------------------------------------------------------------------
# Synthetic checkpoints


def gpt2_config(size: Size):
    from transformers import GPT2Config

    return GPT2Config(n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head, vocab_size=size.vocab,
                      n_positions=size.positions, architectures=["GPT2LMHeadModel"], dtype="float16")


def tensor_shapes(size: Size) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of GPT2LMHeadModel for ``size`` (tied head left out)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(size))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name != "lm_head.weight"}


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Trained-looking random values: γ near 1, small biases, weights of std 0.02, embeddings with a mean."""
    values = torch.randn(shape, generator=generator)
    if ".ln_" in name or name.startswith("transformer.ln_f"):
        values = 1.0 + 0.2 * values if name.endswith(".weight") else 0.1 * values
    elif name.endswith(".bias"):
        values = 0.02 * values
    else:
        values = 0.02 * values
        if name in ("transformer.wte.weight", "transformer.wpe.weight"):
            values += 0.01
    return values.half()


def split_shards(shapes: dict[str, tuple[int, ...]], shards: int) -> list[list[str]]:
    """Names in state-dict order, cut into ``shards`` runs of about equal bytes."""
    sizes = {name: 2 * int(torch.Size(shape).numel()) for name, shape in shapes.items()}
    target = sum(sizes.values()) / shards
    runs: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes.items():
        if filled >= target * len(runs) and len(runs) < shards:
            runs.append([])
        runs[-1].append(name)
        filled += nbytes
    return runs


def build_checkpoint(size: Size, path: Path) -> dict:
    """Write a synthetic fp16 checkpoint of ``size`` at ``path``; returns its parameter count and bytes."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gpt2_config(size).save_pretrained(path)
    shapes = tensor_shapes(size)
    runs = split_shards(shapes, size.shards)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, names in enumerate(runs, 1):
        file = "model.safetensors" if size.shards == 1 else f"model-{index:05d}-of-{size.shards:05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], generator) for name in names}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    if size.shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    params = sum(int(torch.Size(shape).numel()) for shape in shapes.values())
    return {"params": params, "bytes": total, "shards": size.shards}


# ---------------------------------------------------------------------------------------------
# Measuring


def timed(command: list[str]) -> dict:
    """Run ``command`` in a fresh process after a ``sync``: wall seconds, peak RSS (MB), load average."""
    subprocess.run(["sync"], check=True)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    result = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB=%M", *command], capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"failed ({result.returncode}): {' '.join(command)}")
    rss_kb = next(int(line.split("=")[1]) for line in result.stderr.splitlines()[::-1] if line.startswith("MAXRSS_KB="))
    return {"seconds": round(wall, 3), "peak_rss_mb": round(rss_kb / 1024, 1), "load_before": round(load, 2),
            "stdout": result.stdout.strip().splitlines()[-3:]}


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def weights_hash(path: Path) -> str:
    """sha256 over the output's weight files and index, in name order."""
    digest = hashlib.sha256()
    for file in [*weight_files(path), *sorted(path.glob("*.index.json"))]:
        digest.update(file.name.encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def measure_cp(src: Path, work: Path) -> dict:
    """``cp`` of the checkpoint's weight files into a fresh directory."""
    destination = work / "cp"
    destination.mkdir()
    try:
        return timed(["cp", *map(str, weight_files(src)), str(destination)])
    finally:
        shutil.rmtree(destination)


def normswap(*args: str) -> list[str]:
    return [sys.executable, "-m", "normswap", *args]


def bench_size(size: Size, work: Path) -> dict:
    """Every measurement for one size; removes what it wrote."""
    src, out, out_verified = work / f"{size.name}-src", work / f"{size.name}-rms", work / f"{size.name}-rms-v"
    started = time.perf_counter()
    record = {"size": size.name, **build_checkpoint(size, src)}
    record["build_seconds"] = round(time.perf_counter() - started, 1)
    try:
        cp_runs = [measure_cp(src, work)]
        startup = timed(normswap("inspect", str(src)))
        convert = timed(normswap("convert", str(src), "--out", str(out), "--verify", "none", "--quiet"))
        cp_runs.append(measure_cp(src, work))
        verify = timed(normswap("verify", str(src), str(out), "--quiet"))
        converted_hash = weights_hash(out)
        shutil.rmtree(out)
        both = timed(normswap("convert", str(src), "--out", str(out_verified), "--quiet"))
        verification = json.loads((out_verified / "config.json").read_text())["normswap"]["verification"]
        record.update(
            cp_seconds=[run["seconds"] for run in cp_runs],
            cp=cp_runs,
            startup=startup,
            convert=convert,
            verify=verify,
            verify_mode=verification.get("mode", "full"),
            convert_and_verify=both,
            deterministic=weights_hash(out_verified) == converted_hash,
            verification={key: verification[key] for key in ("mode", "passed", "worst_layer") if key in verification},
        )
        record["verification"]["max_abs_diff"] = {
            loader: figures.get("max_abs_diff") for loader, figures in verification["loaders"].items()
        }
    finally:
        for path in (src, out, out_verified):
            shutil.rmtree(path, ignore_errors=True)
    cp_seconds = sum(record["cp_seconds"]) / len(record["cp_seconds"])
    streaming = max(record["convert"]["seconds"] - record["startup"]["seconds"], 1e-3)
    record["convert_over_cp"] = round(record["convert"]["seconds"] / cp_seconds, 2)
    record["streaming_seconds"] = round(streaming, 3)
    record["streaming_over_cp"] = round(streaming / cp_seconds, 2)
    record["convert_seconds_per_gb"] = round(record["convert"]["seconds"] / (record["bytes"] / 1e9), 2)
    record["streaming_seconds_per_gb"] = round(streaming / (record["bytes"] / 1e9), 2)
    return record


# ---------------------------------------------------------------------------------------------
# Report


def table(records: list[dict]) -> str:
    head = ("| size | params | GB | shards | cp s | start-up s | convert s | ×cp | streaming s (convert − start-up) "
            "| streaming ×cp | convert RSS MB | verify s (mode) | verify RSS MB | convert+verify s "
            "| convert+verify RSS MB | same bytes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        cp = sum(r["cp_seconds"]) / len(r["cp_seconds"])
        lines.append(
            f"| {r['size']} | {r['params'] / 1e9:.2f}B | {r['bytes'] / 1e9:.2f} | {r['shards']} | {cp:.2f} "
            f"| {r['startup']['seconds']:.2f} | {r['convert']['seconds']:.2f} | {r['convert_over_cp']:.2f} "
            f"| {r['streaming_seconds']:.2f} | {r['streaming_over_cp']:.2f} "
            f"| {r['convert']['peak_rss_mb']:.0f} | {r['verify']['seconds']:.1f} ({r['verify_mode']}) "
            f"| {r['verify']['peak_rss_mb']:.0f} | {r['convert_and_verify']['seconds']:.1f} "
            f"| {r['convert_and_verify']['peak_rss_mb']:.0f} | {'yes' if r['deterministic'] else 'NO'} |"
        )
    return "\n".join(lines)


def scaling(records: list[dict]) -> dict:
    """Seconds per GB by size, whole conversion and streaming part; largest over smallest (1.0 = linear)."""
    ordered = sorted(records, key=lambda r: r["bytes"])
    result = {}
    for key in ("convert_seconds_per_gb", "streaming_seconds_per_gb"):
        result[key] = {r["size"]: r[key] for r in ordered}
        if len(ordered) > 1:
            result[key + "_largest_over_smallest"] = round(ordered[-1][key] / ordered[0][key], 2)
    return result


def targets(records: list[dict]) -> dict:
    by_size = {r["size"]: r for r in records}
    result = {"convert_within_3x_cp": {r["size"]: r["convert_over_cp"] <= 3.0 for r in records},
              "streaming_within_3x_cp": {r["size"]: r["streaming_over_cp"] <= 3.0 for r in records}}
    if "gpt2-xl" in by_size:
        xl = by_size["gpt2-xl"]
        rss = xl["convert_and_verify"]["peak_rss_mb"]
        cp = sum(xl["cp_seconds"]) / len(xl["cp_seconds"])
        default_over_cp = xl["convert_and_verify"]["seconds"] / cp
        result["xl_convert_and_layerwise_verify_rss_below_1gb"] = {"peak_rss_mb": rss, "met": rss < 1024}
        result["xl_convert_and_verify_rss_at_most_800mb"] = {"peak_rss_mb": rss, "met": rss <= 800}
        result["xl_default_convert_within_8x_cp"] = {"ratio": round(default_over_cp, 2), "met": default_over_cp <= 8}
        # verification alone (its own start-up taken off, as for the conversion's streaming part)
        verify_work = xl["verify"]["seconds"] - xl["startup"]["seconds"]
        result["xl_verify_no_slower_than_streaming"] = {
            "verify_minus_startup_seconds": round(verify_work, 2), "streaming_seconds": xl["streaming_seconds"],
            "met": verify_work <= xl["streaming_seconds"]}
    if "gpt2-small" in by_size:
        small = by_size["gpt2-small"]
        result["smallest_in_seconds"] = {"convert_seconds": small["convert"]["seconds"],
                                         "convert_and_verify_seconds": small["convert_and_verify"]["seconds"]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--workdir", default="/tmp/normswap-bench", help="where synthetic checkpoints go (deleted)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records = []
    try:
        for name in args.sizes.split(","):
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            records.append(bench_size(SIZES[name], work))
            print(table(records[-1:]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "command": "python scripts/bench_convert.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__,
                    "note": "shared machine: other processes (other engineers' jobs) may have been running; "
                            "load_before is the 1-minute load average before each step"},
        "method": "each step a fresh process under /usr/bin/time after sync; peak RSS = max resident set size; "
                  "cp = cp of the same weight files (mean of two runs bracketing the conversion)",
        "results": records,
        "scaling": scaling(records),
        "targets": targets(records),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(records))
    print(json.dumps({"scaling": report["scaling"], "targets": report["targets"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
