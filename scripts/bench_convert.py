"""Benchmark streaming conversion against `cp`: wall time, peak RSS and verification time by size.

Builds synthetic sharded GPT-2 checkpoints with random weights in real shapes (GPT-2-small,
GPT-2-medium ≈ 0.4B, GPT-2-XL ≈ 1.5B; fp16), then for each size, ``--repeat`` rounds (min and
median reported) of these steps, side by side in the same run:

* ``cp`` of the same weight files (read plus write of the same bytes: the floor);
* ``normswap inspect`` (start-up: importing torch and transformers, building the model class on
  meta, planning; no weights read or written), so the fixed cost can be told from the streaming;
* ``python -c "import torch, transformers.models.gpt2.modeling_gpt2"`` (the stock class's import,
  which every verification pays before its forward passes), leaving with ``os._exit`` as
  normswap's commands leave (without the interpreter's teardown), so the part of ``verify`` that
  is normswap's own work can be told from it;
* ``normswap convert --verify none`` (conversion alone): wall time and peak RSS;
* ``normswap verify`` in its automatic mode (whole models when small, layer by layer above
  1 GiB of float32 weights): wall time and peak RSS;
* ``normswap convert`` with default options (conversion plus verification in one process): wall
  time and peak RSS, and whether its weights hash the same as the first conversion's (determinism).

Every step runs in a fresh process under ``/usr/bin/time`` (peak RSS = its max resident set
size), after a ``sync`` so no step pays for the previous one's write-back. After the rounds,
``verify`` and the default ``convert`` run once more with their memory sampled every 50 ms over
the whole process tree (the weights proof runs in a forked process): peak summed Pss, which
counts each shared page once. Results are printed as
a table with the ratios and the scaling with size, and written to
``benchmarks/results/bench_convert.json``. The synthetic checkpoints are deleted afterwards.

    python scripts/bench_convert.py                                  # all sizes, 3 rounds
    python scripts/bench_convert.py --sizes gpt2-small --repeat 1    # quick check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux: /proc/PID/task/TID/children)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    queue.extend(int(child) for child in handle.read().split())
        except OSError:  # it exited meanwhile
            continue
    return found


MEMORY_FIELDS = ("Pss", "Rss", "Anonymous")


def _memory_kb(pid: int) -> dict[str, int]:
    """Pss, Rss and Anonymous of ``pid`` in kB (``MEMORY_FIELDS``), zeros once it is gone."""
    figures = dict.fromkeys(MEMORY_FIELDS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in figures:
                    figures[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return dict.fromkeys(MEMORY_FIELDS, 0)
    return figures


def sample_tree(process: subprocess.Popen, interval: float = 0.05) -> dict:
    """Until ``process`` ends, every ``interval`` s, the memory of it and every process it starts
    (``verify``'s weights proof runs in a forked copy of it): the peaks of their summed
    proportional set size (Pss: each shared page counted once in all, split between the processes
    that map it), of their summed resident set size (shared pages counted in each), and of their
    summed anonymous memory (what the processes allocated, not the checkpoint files they map)."""
    peaks = dict.fromkeys(MEMORY_FIELDS, 0)
    processes = 0
    while process.poll() is None:
        sizes = [_memory_kb(pid) for pid in _descendants(process.pid)]
        for key in MEMORY_FIELDS:
            peaks[key] = max(peaks[key], sum(size[key] for size in sizes))
        processes = max(processes, len([size for size in sizes if size["Rss"]]))
        time.sleep(interval)
    return {"peak_pss_mb": round(peaks["Pss"] / 1024, 1), "peak_summed_rss_mb": round(peaks["Rss"] / 1024, 1),
            "peak_anon_mb": round(peaks["Anonymous"] / 1024, 1), "most_processes": processes,
            "sampled_every_seconds": interval}


def tree_memory(command: list[str], interval: float = 0.05) -> dict:
    """``sample_tree`` of ``command``, run once after a ``sync``."""
    subprocess.run(["sync"], check=True)
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: a chatty command never blocks on it
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        peaks = sample_tree(process, interval)
        if process.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{errors.read()}")
    return peaks


def uptime() -> str:
    """The machine's uptime line (load averages), for the record of a shared machine."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


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


STEPS = ("cp", "startup", "stock_class_import", "convert_no_verify", "verify", "convert_default")
# left as normswap's commands leave, without the interpreter's teardown of every imported object
STOCK_CLASS_IMPORT = [sys.executable, "-c", "import os, torch, transformers.models.gpt2.modeling_gpt2; os._exit(0)"]


def one_round(src: Path, work: Path) -> tuple[dict[str, dict], dict, bool]:
    """Every step once, in a fresh process each: the measurements, the default command's
    verification figures, and whether both conversions wrote the same bytes."""
    out, out_verified = work / "rms", work / "rms-v"
    try:
        steps = {"cp": measure_cp(src, work), "startup": timed(normswap("inspect", str(src))),
                 "stock_class_import": timed(STOCK_CLASS_IMPORT)}
        steps["convert_no_verify"] = timed(normswap("convert", str(src), "--out", str(out), "--verify", "none",
                                                    "--quiet"))
        steps["verify"] = timed(normswap("verify", str(src), str(out), "--quiet"))
        converted_hash = weights_hash(out)
        shutil.rmtree(out)
        steps["convert_default"] = timed(normswap("convert", str(src), "--out", str(out_verified), "--quiet"))
        verification = json.loads((out_verified / "config.json").read_text())["normswap"]["verification"]
        return steps, verification, weights_hash(out_verified) == converted_hash
    finally:
        for path in (out, out_verified):
            shutil.rmtree(path, ignore_errors=True)


def process_tree_memory(src: Path, work: Path) -> dict:
    """``tree_memory`` of ``verify`` and of the default ``convert``, once each, after the rounds."""
    out, out_verified = work / "rms", work / "rms-v"
    try:
        subprocess.run(normswap("convert", str(src), "--out", str(out), "--verify", "none", "--quiet"), check=True,
                       stdout=subprocess.DEVNULL)
        memory = {"verify": tree_memory(normswap("verify", str(src), str(out), "--quiet"))}
        memory["convert_default"] = tree_memory(normswap("convert", str(src), "--out", str(out_verified), "--quiet"))
        return memory
    finally:
        for path in (out, out_verified):
            shutil.rmtree(path, ignore_errors=True)


def summary(runs: list[dict]) -> dict:
    """Min and median wall seconds and peak RSS of one step over its runs."""
    seconds = [run["seconds"] for run in runs]
    rss = [run["peak_rss_mb"] for run in runs]
    return {"min_seconds": min(seconds), "median_seconds": round(statistics.median(seconds), 3),
            "min_peak_rss_mb": min(rss), "median_peak_rss_mb": round(statistics.median(rss), 1),
            "max_peak_rss_mb": max(rss), "runs": runs}


def bench_size(size: Size, work: Path, repeat: int = 1) -> dict:
    """Every measurement for one size, ``repeat`` rounds; removes what it wrote."""
    src = work / f"{size.name}-src"
    started = time.perf_counter()
    record = {"size": size.name, "repeat": repeat, **build_checkpoint(size, src)}
    record["build_seconds"] = round(time.perf_counter() - started, 1)
    rounds: dict[str, list[dict]] = {step: [] for step in STEPS}
    try:
        for _ in range(repeat):
            steps, verification, deterministic = one_round(src, work)
            for step, measured in steps.items():
                rounds[step].append(measured)
            record["deterministic"] = record.get("deterministic", True) and deterministic
        record["memory"] = process_tree_memory(src, work)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    record["steps"] = {step: summary(runs) for step, runs in rounds.items()}
    record["verification"] = {key: verification[key] for key in ("mode", "passed", "worst_layer", "proof",
                                                                 "probe_shape") if key in verification}
    record["verification"]["max_abs_diff"] = {
        loader: figures.get("max_abs_diff") for loader, figures in verification["loaders"].items()
    }
    median = {step: figures["median_seconds"] for step, figures in record["steps"].items()}
    streaming = max(median["convert_no_verify"] - median["startup"], 1e-3)
    record["streaming_seconds"] = round(streaming, 3)
    record["ratios"] = {
        "convert_no_verify_over_cp": round(median["convert_no_verify"] / median["cp"], 2),
        "streaming_over_cp": round(streaming / median["cp"], 2),
        "convert_default_over_cp": round(median["convert_default"] / median["cp"], 2),
        "verify_over_cp": round(median["verify"] / median["cp"], 2),
        "stock_class_import_over_cp": round(median["stock_class_import"] / median["cp"], 2),
        "verify_beyond_stock_class_import_over_cp": round((median["verify"] - median["stock_class_import"])
                                                          / median["cp"], 2),
        "verify_work_over_streaming": round((median["verify"] - median["startup"]) / streaming, 2),
    }
    record["seconds_per_gb"] = {"convert_no_verify": round(median["convert_no_verify"] / (record["bytes"] / 1e9), 2),
                                "streaming": round(streaming / (record["bytes"] / 1e9), 2)}
    return record


# ---------------------------------------------------------------------------------------------
# Report


def table(records: list[dict]) -> str:
    """One row per size and step: min and median seconds, peak RSS, ratio to cp (medians)."""
    lines = ["| size | step | min s | median s | ×cp (median) | peak RSS MB (median, max) | runs |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        cp = r["steps"]["cp"]["median_seconds"]
        for step, f in r["steps"].items():
            lines.append(f"| {r['size']} ({r['bytes'] / 1e9:.2f} GB) | {step} | {f['min_seconds']:.2f} "
                         f"| {f['median_seconds']:.2f} | {f['median_seconds'] / cp:.1f} "
                         f"| {f['median_peak_rss_mb']:.0f}, {f['max_peak_rss_mb']:.0f} | {len(f['runs'])} |")
    return "\n".join(lines)


def scaling(records: list[dict]) -> dict:
    """Seconds per GB by size, whole conversion and streaming part; largest over smallest (1.0 = linear)."""
    ordered = sorted(records, key=lambda r: r["bytes"])
    result = {}
    for key in ("convert_no_verify", "streaming"):
        result[key] = {r["size"]: r["seconds_per_gb"][key] for r in ordered}
        if len(ordered) > 1:
            result[key + "_largest_over_smallest"] = round(ordered[-1]["seconds_per_gb"][key]
                                                           / ordered[0]["seconds_per_gb"][key], 2)
    return result


def targets(records: list[dict]) -> dict:
    """The 1.5B checkpoint's targets, judged on medians; memory on the worst run's peak RSS and on
    the process tree's peak Pss (the proof's forked process included)."""
    by_size = {r["size"]: r for r in records}
    if "gpt2-xl" not in by_size:
        return {}
    xl = by_size["gpt2-xl"]

    def memory(step: str) -> dict:
        rss, pss = xl["steps"][step]["max_peak_rss_mb"], xl["memory"][step]["peak_pss_mb"]
        return {"peak_rss_mb": rss, "process_tree_peak_pss_mb": pss, "met": max(rss, pss) <= 800}

    return {
        "default_convert_within_4x_cp": {"ratio": xl["ratios"]["convert_default_over_cp"],
                                         "met": xl["ratios"]["convert_default_over_cp"] <= 4},
        "default_convert_memory_at_most_800mb": memory("convert_default"),
        "verify_within_2x_cp": {"ratio": xl["ratios"]["verify_over_cp"], "met": xl["ratios"]["verify_over_cp"] <= 2,
                                "stock_class_import_ratio": xl["ratios"]["stock_class_import_over_cp"]},
        "verify_memory_at_most_800mb": memory("verify"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    parser.add_argument("--workdir", default="/tmp/normswap-bench", help="where synthetic checkpoints go (deleted)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every step per size (min and median)")
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records = []
    try:
        for name in args.sizes.split(","):
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            records.append(bench_size(SIZES[name], work, args.repeat))
            print(table(records[-1:]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "command": "python scripts/bench_convert.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__,
                    "note": "other processes may have been running; "
                            "load_before is the 1-minute load average before each step"},
        "method": "each step a fresh process under /usr/bin/time after sync, the steps of a round in turn; "
                  "peak RSS = max resident set size; cp = cp of the same weight files; streaming = median "
                  "convert_no_verify - median startup; verify work = median verify - median startup",
        "uptime": uptime(),
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
