"""Cost against model size: convert and verify against the read+write floor, 1.5B to 13B.

Builds random fp16 checkpoints of real shapes tensor by tensor (no model is materialised: each
shard's safetensors header is written first, then each tensor's bytes in turn), sharded as hub
repositories are, then measures in interleaved rounds, each step a fresh process after a
``sync``:

* ``floor``: every tensor read with safetensors (``safe_open``, ``get_tensor``) and written back
  unchanged into new shards, in a fresh Python process (the bytes any conversion must move);
* ``convert --verify none``: the conversion alone;
* ``verify``: verification of the pair just written;
* ``convert``: the default command, conversion plus verification.

Each step reports wall seconds, its ratio to the floor of the same round, and the peak memory
of its whole process tree (``verify``'s weights proof runs in a forked copy), sampled every
50 ms: summed Pss (each shared page counted once) and summed RSS, and what the tree read from
storage (Linux's ``read_bytes``: page-cache misses), also against the bytes the step must read
(the source; both folders for ``verify``). With ``--cold`` (root) the page cache is emptied
before every step, so that a figure near 1.0 says each byte came from the disk once. The
``startup`` step (``normswap inspect``: planning, no weights read) is measured beside them, and
across sizes each step's seconds are fitted as a fixed cost plus a per-GB cost. Results go to
``benchmarks/results/bench_scale.json`` and are printed as a table; the checkpoints are deleted
afterwards.

    python scripts/bench_scale.py                                    # 1.5B and 6.7B, 2 rounds
    python scripts/bench_scale.py --sizes gpt2-xl,opt-6.7b,opt-13b   # 13B where the disk allows
    python scripts/bench_scale.py --sizes opt-6.7b --rounds 1 --cold # reads from the disk, as root
    python scripts/bench_scale.py --quick --out /tmp/scale.json      # a tiny shape (the tests run it)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import sample_tree  # noqa: E402  (the process-tree sampling they share)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_scale.json"
STEPS = ("floor", "startup", "convert_no_verify", "verify", "convert_default")
TARGETS = {"convert_default": 2.0, "verify": 1.5}  # at most this many times the floor
MEMORY_TARGET_MB = 1024


@dataclass(frozen=True)
class Shape:
    """A model shape: its family's config, and how many shards its checkpoint is cut into."""

    name: str
    family: str  # "gpt2" or "opt"
    layers: int
    width: int
    heads: int
    ffn: int
    vocab: int
    positions: int
    shards: int


SHAPES = {
    "tiny": Shape("tiny", "opt", 2, 64, 4, 256, 512, 64, shards=2),
    "gpt2-xl": Shape("gpt2-xl", "gpt2", 48, 1600, 25, 6400, 50257, 1024, shards=1),
    "opt-6.7b": Shape("opt-6.7b", "opt", 32, 4096, 32, 16384, 50272, 2048, shards=3),
    "opt-13b": Shape("opt-13b", "opt", 40, 5120, 40, 20480, 50272, 2048, shards=3),
    # OPT-6.7B's width and vocabulary in two blocks: memory against width at a small size on disk
    "opt-6.7b-2-layers": Shape("opt-6.7b-2-layers", "opt", 2, 4096, 32, 16384, 50272, 2048, shards=1),
}
DEFAULT_SIZES = ("gpt2-xl", "opt-6.7b")


def model_config(shape: Shape):
    import transformers

    if shape.family == "gpt2":
        return transformers.GPT2Config(n_layer=shape.layers, n_embd=shape.width, n_head=shape.heads,
                                       n_inner=shape.ffn, vocab_size=shape.vocab, n_positions=shape.positions,
                                       architectures=["GPT2LMHeadModel"], dtype="float16")
    return transformers.OPTConfig(num_hidden_layers=shape.layers, hidden_size=shape.width, num_attention_heads=shape.heads,
                                  ffn_dim=shape.ffn, vocab_size=shape.vocab, max_position_embeddings=shape.positions,
                                  word_embed_proj_dim=shape.width, architectures=["OPTForCausalLM"], dtype="float16")


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """The state dict's names and shapes, from the class built on the meta device (tied head left out)."""
    import torch
    import transformers

    config = model_config(shape)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name != "lm_head.weight"}


def random_values(name: str, shape: tuple[int, ...], generator):
    """fp16 values that look trained: gains near 1, small biases, weights of std 0.02 with a mean."""
    import torch

    values = torch.randn(shape, generator=generator)
    if len(shape) == 1 and ("norm" in name or ".ln_" in name):
        return (1.0 + 0.2 * values if name.endswith(".weight") else 0.1 * values).half()
    return (0.02 * values + (0.01 if "embed" in name or ".wte." in name or ".wpe." in name else 0.0)).half()


def shard_runs(shapes: dict[str, tuple[int, ...]], shards: int) -> list[list[str]]:
    """Names in state-dict order, cut into ``shards`` runs of about equal bytes."""
    sizes = {name: 2 * _count(shape) for name, shape in shapes.items()}
    target, runs, filled = sum(sizes.values()) / shards, [[]], 0
    for name, nbytes in sizes.items():
        if filled >= target * len(runs) and len(runs) < shards:
            runs.append([])
        runs[-1].append(name)
        filled += nbytes
    return runs


def _count(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def shard_header(names: list[str], shapes: dict[str, tuple[int, ...]], metadata: dict) -> tuple[bytes, int]:
    """The safetensors header of fp16 ``names`` in order (length prefix included), and their bytes."""
    header, offset = {"__metadata__": metadata}, 0
    for name in names:
        nbytes = 2 * _count(shapes[name])
        header[name] = {"dtype": "F16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, offset


def write_shard(path: Path, names: list[str], shapes: dict[str, tuple[int, ...]], generator) -> int:
    """A safetensors file of fp16 ``names``, its header first, then one tensor at a time."""
    header, total = shard_header(names, shapes, {"format": "pt"})
    with open(path, "wb") as handle:
        handle.write(header)
        for name in names:
            handle.write(random_values(name, shapes[name], generator).numpy().tobytes())
    return total


def build_checkpoint(shape: Shape, path: Path) -> dict:
    """A random fp16 checkpoint of ``shape`` at ``path``: its parameters, bytes and shards."""
    import torch

    path.mkdir(parents=True)
    model_config(shape).save_pretrained(path)
    shapes = tensor_shapes(shape)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, names in enumerate(shard_runs(shapes, shape.shards), 1):
        file = "model.safetensors" if shape.shards == 1 else f"model-{index:05d}-of-{shape.shards:05d}.safetensors"
        total += write_shard(path / file, names, shapes, generator)
        weight_map.update(dict.fromkeys(names, file))
    if shape.shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"params": sum(_count(each) for each in shapes.values()), "bytes": total, "shards": shape.shards}


def floor_copy(source: Path, destination: Path) -> None:
    """Every tensor read with safetensors and written back unchanged, one tensor at a time (the
    ``floor`` step's whole work; run in a fresh process by ``--floor``)."""
    from safetensors import safe_open

    destination.mkdir()
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), "pt") as reader:
            names = list(reader.keys())
            shapes = {name: tuple(reader.get_slice(name).get_shape()) for name in names}
            header, _ = shard_header(names, shapes, reader.metadata() or {})
            with open(destination / file.name, "wb") as handle:
                handle.write(header)
                for name in names:
                    handle.write(reader.get_tensor(name).numpy().tobytes())


# ---------------------------------------------------------------------------------------------
# Measuring


def storage_read_bytes() -> int:
    """The bytes this process and every descendant it has reaped caused to be read from storage
    (Linux's ``read_bytes``: page-cache misses, by ``read`` or by a fault on mapped pages)."""
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("read_bytes:"))


def drop_page_cache() -> None:
    """Empty the page cache (root only), so that a step reads what it reads from the disk."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def measured(command: list[str], interval: float = 0.05, cold: bool = False) -> dict:
    """Run ``command`` after a ``sync`` (and with ``cold`` an empty page cache): wall seconds, the
    peak summed Pss, RSS and anonymous memory of its process tree, sampled every ``interval``
    seconds, and what the tree read from storage (``storage_read_bytes``)."""
    if cold:
        drop_page_cache()
    subprocess.run(["sync"], check=True)
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: a chatty command never blocks on it
        read_before = storage_read_bytes()
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        peaks = sample_tree(process, interval)
        seconds = time.perf_counter() - started
        read = storage_read_bytes() - read_before
        if process.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n{errors.read()[-2000:]}")
    return {"seconds": round(seconds, 3), "peak_pss_mb": peaks["peak_pss_mb"],
            "peak_rss_mb": peaks["peak_summed_rss_mb"], "peak_anon_mb": peaks["peak_anon_mb"],
            "storage_read_mb": round(read / 2**20, 1), "load_before": round(load, 2)}


def normswap(*args: str) -> list[str]:
    return [sys.executable, "-m", "normswap", *args]


def folder_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def one_round(src: Path, work: Path, cold: bool = False) -> dict[str, dict]:
    """Every step once, in turn, each in a fresh process (with ``cold``, on an empty page cache);
    what they wrote is removed. Each step's storage reads are also given against the bytes it
    must read: the source for a conversion, both folders for ``verify``."""
    floor, out, verified = work / "floor", work / "rms", work / "rms-verified"
    step = partial(measured, cold=cold)
    try:
        steps = {"floor": step([sys.executable, __file__, "--floor", str(src), str(floor)])}
        shutil.rmtree(floor)
        steps["startup"] = step(normswap("inspect", str(src)))
        steps["convert_no_verify"] = step(normswap("convert", str(src), "--out", str(out), "--verify", "none",
                                                   "--quiet"))
        steps["verify"] = step(normswap("verify", str(src), str(out), "--quiet"))
        source = folder_bytes(src)
        needed = {"floor": source, "convert_no_verify": source, "convert_default": source,
                  "verify": source + folder_bytes(out)}
        shutil.rmtree(out)
        steps["convert_default"] = step(normswap("convert", str(src), "--out", str(verified), "--quiet"))
        for name in STEPS:
            steps[name]["over_floor"] = round(steps[name]["seconds"] / steps["floor"]["seconds"], 2)
            if name in needed:
                steps[name]["storage_read_over_bytes"] = round(steps[name]["storage_read_mb"] * 2**20 / needed[name], 3)
        return steps
    finally:
        for path in (floor, out, verified):
            shutil.rmtree(path, ignore_errors=True)


def bench_shape(shape: Shape, work: Path, rounds: int, cold: bool = False) -> dict:
    """Every step for one shape, ``rounds`` interleaved rounds; the checkpoint is removed after."""
    src = work / f"{shape.name}-src"
    started = time.perf_counter()
    record = {"size": shape.name, **build_checkpoint(shape, src)}
    record["build_seconds"] = round(time.perf_counter() - started, 1)
    try:
        record["rounds"] = [one_round(src, work, cold) for _ in range(rounds)]
    finally:
        shutil.rmtree(src, ignore_errors=True)
    record["median"] = {step: {key: round(statistics.median(r[step][key] for r in record["rounds"]), 3)
                               for key in ("seconds", "over_floor", "peak_pss_mb", "peak_rss_mb", "peak_anon_mb",
                                           "storage_read_mb")}
                        for step in STEPS}
    median = record["median"]
    measured = [step for step in STEPS if step != "floor"]
    anon = max(median[step]["peak_anon_mb"] for step in measured)
    record["targets"] = {
        **{f"{step}_within_{limit:g}x_floor": {"ratio": median[step]["over_floor"],
                                               "met": median[step]["over_floor"] <= limit}
           for step, limit in TARGETS.items()},
        # what the steps allocate: the mapped checkpoint pages that Pss also counts are the page cache's
        "peak_memory_within_1gb": {"anon_mb": anon, "pss_mb": max(median[step]["peak_pss_mb"] for step in measured),
                                   "met": anon <= MEMORY_TARGET_MB},
    }
    return record


# ---------------------------------------------------------------------------------------------
# Report


def cost_split(records: list[dict]) -> dict:
    """Each step's median seconds as fixed + per-GB cost, a least-squares line through the sizes
    measured (at least two); the floor's own per-GB cost beside it."""
    if len(records) < 2:
        return {}
    gigabytes = [record["bytes"] / 1e9 for record in records]
    split = {}
    for step in STEPS:
        seconds = [record["median"][step]["seconds"] for record in records]
        mean_x, mean_y = statistics.fmean(gigabytes), statistics.fmean(seconds)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(gigabytes, seconds, strict=True))
                 / sum((x - mean_x) ** 2 for x in gigabytes))
        split[step] = {"fixed_seconds": round(mean_y - slope * mean_x, 2), "seconds_per_gb": round(slope, 2)}
    return split


def table(records: list[dict]) -> str:
    """One row per shape and step: median seconds, ratio to the floor, peak Pss, RSS and anonymous
    memory of the tree."""
    lines = ["| size | step | median s | × floor (median) | peak Pss MB | peak RSS MB | peak anon MB "
             "| storage read GB | rounds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        for step, figures in record["median"].items():
            lines.append(f"| {record['size']} ({record['bytes'] / 1e9:.2f} GB, {record['shards']} shards) | {step} "
                         f"| {figures['seconds']:.2f} | {figures['over_floor']:.2f} | {figures['peak_pss_mb']:.0f} "
                         f"| {figures['peak_rss_mb']:.0f} | {figures['peak_anon_mb']:.0f} "
                         f"| {figures['storage_read_mb'] * 2**20 / 1e9:.2f} | {len(record['rounds'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help="one round of the tiny shape")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every step per size")
    parser.add_argument("--workdir", default="/tmp/normswap-bench-scale", help="where checkpoints go (deleted)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON results file")
    parser.add_argument("--cold", action="store_true",
                        help="empty the page cache before every step (root only): reads come from the disk")
    parser.add_argument("--floor", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)  # the floor's process
    args = parser.parse_args(argv)
    if args.floor:
        floor_copy(Path(args.floor[0]), Path(args.floor[1]))
        return 0
    sizes, rounds = (["tiny"], 1) if args.quick else (args.sizes.split(","), args.rounds)
    unknown = [size for size in sizes if size not in SHAPES]
    if unknown:
        parser.error(f"unknown size {unknown[0]}; choose from {', '.join(SHAPES)}")
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--cold empties the page cache, which needs root")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records = []
    try:
        for size in sizes:
            print(f"[bench_scale] {size} ...", file=sys.stderr, flush=True)
            records.append(bench_shape(SHAPES[size], work, rounds, args.cold))
            print(table(records[-1:]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import torch

    report = {
        "command": "python scripts/bench_scale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "memory_gb": round(os.sysconf("SC_PAGE_SIZE")
                                                                   * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "method": "rounds interleave the steps; each step a fresh process after sync"
                  + (" on an emptied page cache" if args.cold else "") + "; ratios are to the floor "
                  "of the same round; memory is the process tree's peak summed Pss and RSS, sampled every 50 ms; "
                  "storage reads are the tree's read_bytes (page-cache misses)",
        "cold": args.cold,
        "results": records,
        "split": cost_split(records),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(table(records))
    print(json.dumps({record["size"]: record["targets"] for record in records}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
