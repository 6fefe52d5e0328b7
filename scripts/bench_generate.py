"""End to end: a LayerNorm GPT-2 against its conversion loaded with normswap.load, side by side.

    python scripts/bench_generate.py --out benchmarks/results/gpu/bench_generate-cuda.json
                                                     # CUDA, bf16: GPT-2-small and 1.3B shapes
    python scripts/bench_generate.py --cpu           # CPU, fp32: the same table on small shapes
    python scripts/bench_generate.py --cpu --quick   # tiny shapes and settings, to check the script

Models have random weights (speed does not depend on their values). ``original`` is the stock
``GPT2LMHeadModel`` with its LayerNorms; ``converted`` is ``normswap.convert_model(original)``
written with ``normswap.save`` and read back with ``normswap.load``: normswap's kernels, the
residual adds fused into the norms they feed.

Phases: ``prefill``, one forward over a batch of prompts (32 x 512 on CUDA); ``decode``,
``model.generate`` of 128 new tokens (greedy, every token generated) at batch 1 and 32 from a
128-token prompt, reported per new token, the time from the first generated token to the last
(prefill excluded; a streamer takes the time stamps, and generate synchronises every step).

Modes: ``eager``; ``compiled``, ``normswap.kernels.compile_for_generation`` on both models
(static cache, ``torch.compile(fullgraph=True, mode="reduce-overhead")``: CUDA graphs), the
norms decomposed into torch ops that Inductor fuses; ``compiled-kernel``, the same with the
norms as normswap's kernel (a custom op). On CPU the compiled modes trace with the ``eager``
backend: they check that the models compile without graph breaks; their times mean little.

Rounds alternate the two models so drift hits them alike; medians are reported. JSON: ``rows``
of {model, phase, batch, mode, original_ms, converted_ms, speedup}, written after every row
(a run cut short keeps what it measured). Only where ``--out`` says.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.streamers import BaseStreamer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import normswap  # noqa: E402
from normswap.kernels import compile_for_generation  # noqa: E402

VOCAB = 50257
# name -> (n_layer, n_embd, n_head)
SHAPES = {
    "cuda": {"gpt2-small": (12, 768, 12), "gpt2-1.3b": (24, 2048, 16)},
    "cpu": {"gpt2-small-cpu": (4, 256, 4)},
    "quick": {"gpt2-tiny": (2, 64, 2)},
}
# prefill (batch, length); decode batches, prompt length, new tokens; timing rounds
SETTINGS = {
    "cuda": {"prefill": (32, 512), "decode": (1, 32), "prompt": 128, "new": 128, "rounds": 2},
    "cpu": {"prefill": (4, 64), "decode": (1, 4), "prompt": 16, "new": 16, "rounds": 2},
    "quick": {"prefill": (2, 16), "decode": (1, 2), "prompt": 8, "new": 4, "rounds": 1},
}
MODES = ("eager", "compiled", "compiled-kernel")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(shape: tuple[int, int, int], device: str, dtype: torch.dtype, folder: Path) -> tuple:
    """(original, converted through normswap.save and normswap.load), on ``device`` in ``dtype``."""
    n_layer, n_embd, n_head = shape
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=VOCAB, n_positions=1024)
    torch.manual_seed(0)
    with torch.device(device):
        original = GPT2LMHeadModel(config).to(dtype).eval()
    normswap.save(normswap.convert_model(original), folder)
    converted = normswap.load(folder, dtype=dtype).to(device).eval()
    for model in (original, converted):
        model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    return original, converted


class _Stamps(BaseStreamer):
    """Time stamps of generate's token outputs: the prompt, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def decode_ms(model, prompt: torch.Tensor, new: int) -> float:
    """Milliseconds per new token of greedy generate, first new token to last."""
    stamps = _Stamps()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, streamer=stamps)  # fmt: skip
    tokens = stamps.times[1:]  # [0] is the prompt
    return (tokens[-1] - tokens[0]) / (len(tokens) - 1) * 1e3


def prefill_ms(model, ids: torch.Tensor, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False)
    sync(device)
    return (time.perf_counter() - start) * 1e3


def side_by_side(models: dict, rounds: int, measure) -> dict[str, float]:
    """Median of ``measure(model)`` per model, alternating within rounds, after one warm-up each."""
    samples = {name: [] for name in models}
    for model in models.values():
        measure(model)
    for _ in range(rounds):
        for name, model in models.items():
            samples[name].append(measure(model))
    return {name: statistics.median(values) for name, values in samples.items()}


def set_mode(models: dict, mode: str, device: str) -> None:
    """Compile both models for ``mode`` (their forwards are restored for ``eager``)."""
    torch._dynamo.reset()
    # two models, prefill and decode shapes through one code object: more graphs than the default
    torch._dynamo.config.recompile_limit = 64
    for model in models.values():
        model.__dict__.pop("forward", None)
        model.generation_config.cache_implementation = None
        if mode != "eager":
            on_cuda = device == "cuda"
            compile_for_generation(model, mode="reduce-overhead" if on_cuda else None,
                                   norm_path="kernel" if mode == "compiled-kernel" else "decompose",
                                   backend="inductor" if on_cuda else "eager")  # fmt: skip


def logit_diff(models: dict, device: str) -> float:
    """max |Δlogit| / max |logit| of the converted model against the original on one prompt."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        want, got = (models[k](input_ids=ids).logits.float() for k in ("original", "converted"))
    return float((got - want).abs().max() / want.abs().max())


def bench_mode(name: str, models: dict, device: str, settings: dict, mode: str, add_row) -> None:
    """Every phase of one (model, mode) pair, a row each."""
    gen = torch.Generator().manual_seed(1)
    batch, length = settings["prefill"]
    prefill = torch.randint(0, VOCAB, (batch, length), generator=gen).to(device)
    prompts = {b: torch.randint(0, VOCAB, (b, settings["prompt"]), generator=gen).to(device)
               for b in settings["decode"]}  # fmt: skip
    set_mode(models, mode, device)
    try:
        with torch.inference_mode():
            for b, prompt in prompts.items():
                ms = side_by_side(models, settings["rounds"], lambda m, p=prompt: decode_ms(m, p, settings["new"]))
                add_row(name, "decode", b, mode, ms, new_tokens=settings["new"])
            ms = side_by_side(models, settings["rounds"], lambda m: prefill_ms(m, prefill, device))
            add_row(name, "prefill", batch, mode, ms, length=length)
    finally:
        set_mode(models, "eager", device)


def plan(names: list[str], modes: list[str]) -> list[tuple[str, str]]:
    """(model, mode) pairs in the order they run: every model eager first, then the compiled modes
    (slow to compile) model by model, so a run cut short has the eager table complete."""
    return [(n, m) for m in modes if m == "eager" for n in names] + [(n, m) for n in names for m in modes if m != "eager"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA exists (small shapes)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and settings")
    parser.add_argument("--models", help="comma-separated subset of the shapes' names")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: steadier)")
    parser.add_argument("--new-tokens", type=int, help="decode this many new tokens (default: the device's setting)")
    parser.add_argument("--rounds", type=int, help="timing rounds (default: the device's setting)")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    kind = "quick" if args.quick else device
    shapes, settings = SHAPES[kind], dict(SETTINGS[kind])
    for key, value in (("new", args.new_tokens), ("rounds", args.rounds)):
        if value is not None:
            if value < 1:
                parser.error(f"--{'new-tokens' if key == 'new' else 'rounds'} must be >= 1")
            settings[key] = value
    names = args.models.split(",") if args.models else list(shapes)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started = time.time()
    report = {"meta": {
        "script": "scripts/bench_generate.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "settings": settings,
        "shapes": {n: shapes[n] for n in names}, "kind": kind,
    }, "models": {}, "rows": []}  # fmt: skip

    def save() -> None:
        report["meta"]["seconds"] = round(time.time() - started, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    def add_row(model, phase, batch, mode, ms, **extra) -> None:
        row = {"model": model, "phase": phase, "batch": batch, "mode": mode, "original_ms": ms["original"],
               "converted_ms": ms["converted"], "speedup": ms["original"] / ms["converted"], **extra}  # fmt: skip
        report["rows"].append(row)
        print(f"{model:<15} {phase:<8} b={batch:<3} {mode:<16} original {row['original_ms']:9.3f} ms  "
              f"converted {row['converted_ms']:9.3f} ms  x{row['speedup']:.3f}", flush=True)  # fmt: skip
        save()

    built: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_generate-") as tmp:
        for name, mode in plan(names, args.modes.split(",")):
            if name not in built:
                original, converted = build(shapes[name], device, dtype, Path(tmp) / name)
                built[name] = {"original": original, "converted": converted}
                report["models"][name] = {"params": sum(p.numel() for p in original.parameters()),
                                          "max_rel_logit_diff": logit_diff(built[name], device)}  # fmt: skip
                save()
            bench_mode(name, built[name], device, settings, mode, add_row)
    save()
    print(f"wrote {args.out} ({report['meta']['seconds']} s)" if args.out else f"done ({report['meta']['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
