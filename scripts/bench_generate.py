"""End to end: original GPT-2 (LayerNorm) against its normswap conversion; JSON to benchmarks/results/.

    python scripts/bench_generate.py            # CUDA: GPT-2-small and ~1B configs, bf16 (~3 min)
    python scripts/bench_generate.py --cpu      # CPU: GPT-2-small, fp32, one thread (~1 min)
    python scripts/bench_generate.py --quick    # tiny settings, for checking the script

Models have random weights (speed does not depend on their values). Three are timed:

* ``original``: the stock ``GPT2LMHeadModel`` with its LayerNorms;
* ``converted``: ``normswap.convert_model(original)``, plain-torch RMSNorms (the remote-code path);
* ``patched``: the same after ``normswap.patch``: kernels, and the attention residual add fused
  into ``ln_2``.

Reported: prefill tokens/s (one forward over a prompt, cache on) and decode latency per token at
batch 1 and 32 (single-token forwards against a KV cache, fixed token ids so every model does
identical work). Rounds alternate between the models so drift hits them alike; medians reported.
The converted models' logits are compared with the original's first, for a prompt and for one
decode step against the prompt's KV cache (they agree to rounding).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import normswap  # noqa: E402
from normswap.kernels import patch as kernels_patch  # noqa: E402

CONFIGS = {
    "gpt2-small": {"n_layer": 12, "n_embd": 768, "n_head": 12},  # 124M
    "gpt2-1b": {"n_layer": 18, "n_embd": 2048, "n_head": 16},  # 1.0B (12 * 18 * 2048**2 + embeddings)
}
# per mode: prefill (batch, prompt length) pairs; decode batches, context length and steps;
# timing rounds after one warm-up. CPU prompts are short so the run fits in about a minute.
SETTINGS = {
    "cuda": {"prefill": [(1, 512), (32, 512)], "decode": [1, 32], "context": 128, "steps": 64, "rounds": 5},
    "cpu": {"prefill": [(1, 64), (32, 8)], "decode": [1, 32], "context": 16, "steps": 4, "rounds": 4},
    "quick": {"prefill": [(1, 16), (4, 8)], "decode": [1, 4], "context": 8, "steps": 3, "rounds": 2},
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_models(name: str, device: str, dtype: torch.dtype, quick: bool) -> dict:
    """{"original", "converted", "patched"} models."""
    shape = {"n_layer": 2, "n_embd": 64, "n_head": 2} if quick else CONFIGS[name]
    config = GPT2Config(**shape, vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    with torch.device(device):
        original = GPT2LMHeadModel(config).eval()
    converted = normswap.convert_model(original)
    original, converted = original.to(dtype), converted.to(dtype).eval()
    return {"original": original, "converted": converted, "patched": kernels_patch(copy.deepcopy(converted))}


def cache_kwarg(model) -> str:
    """The KV-cache keyword of this transformers version (``cache``; ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward(model, ids, cache=None):
    kwargs = {cache_kwarg(model): cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=True, **kwargs)
    return out, getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def time_prefill(model, ids, device) -> float:
    sync(device)
    start = time.perf_counter()
    forward(model, ids)
    sync(device)
    return time.perf_counter() - start


def time_decode(model, context, steps, device) -> float:
    """Seconds per decode step (one token per sequence) after prefilling ``context``."""
    _, cache = forward(model, context)
    step_ids = torch.randint(0, 50257, (context.shape[0], steps), generator=torch.Generator().manual_seed(2))
    step_ids = step_ids.to(context.device)
    sync(device)
    start = time.perf_counter()
    for i in range(steps):
        _, cache = forward(model, step_ids[:, i : i + 1], cache)
    sync(device)
    return (time.perf_counter() - start) / steps


def compare_logits(models: dict, device: str) -> dict:
    """max |Δlogit| / max |logit| against the original: a prompt, then one cached decode step."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50257, (2, 16), generator=gen).to(device)
    step = torch.randint(0, 50257, (2, 1), generator=gen).to(device)
    outputs = {}
    for name, model in models.items():
        out, cache = forward(model, ids)
        outputs[name] = (out.logits.float(), forward(model, step, cache)[0].logits.float())
    ref = outputs["original"]
    return {
        name: {kind: float((got[i] - ref[i]).abs().max() / ref[i].abs().max()) for i, kind in enumerate(("prompt", "step"))}
        for name, got in outputs.items() if name != "original"
    }  # fmt: skip


def alternate(models: dict, rounds: int, measure) -> dict:
    """Median of ``measure(model)`` per model, models alternating within each round."""
    samples = {name: [] for name in models}
    for model in models.values():  # warm-up: kernel compiles, allocator, caches
        measure(model)
    for _ in range(rounds):
        for name, model in models.items():
            samples[name].append(measure(model))
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_config(name: str, device: str, dtype: torch.dtype, settings: dict, quick: bool, entry: dict, save) -> None:
    """Fill ``entry`` with one configuration's figures, calling ``save()`` after each (partial
    results survive a time limit)."""
    models = build_models(name, device, dtype, quick)
    entry.update(config=name, dtype=str(dtype).removeprefix("torch."),
                 params=sum(p.numel() for p in models["original"].parameters()))  # fmt: skip
    with torch.inference_mode():
        entry["max_rel_logit_diff"] = compare_logits(models, device)
        gen = torch.Generator().manual_seed(1)
        for batch, length in settings["prefill"]:
            prompt = torch.randint(0, 50257, (batch, length), generator=gen).to(device)
            seconds = alternate(models, settings["rounds"], lambda m, p=prompt: time_prefill(m, p, device))
            report(entry, f"prefill_b{batch}_t{length}", summarise(seconds, batch * length, "prefill"))
            save()
        for batch in settings["decode"]:
            context = torch.randint(0, 50257, (batch, settings["context"]), generator=gen).to(device)
            per_step = alternate(
                models, settings["rounds"], lambda m, c=context: time_decode(m, c, settings["steps"], device)
            )
            report(entry, f"decode_b{batch}", summarise(per_step, batch, "decode"))
            save()


def report(entry: dict, key: str, rows: dict) -> None:
    entry[key] = rows
    unit = "ms" if "ms" in rows["original"] else "ms_per_token"
    cells = "  ".join(
        f"{name} {row[unit]:.2f} ms {row['tokens_per_s']:.0f} tok/s x{row['speedup_vs_original']:.3f}"
        for name, row in rows.items()
    )
    print(f"{entry['config']:<10} {key:<16} {cells}", flush=True)


def summarise(seconds: dict, tokens: int, kind: str) -> dict:
    """Per model: time, tokens/s, and the speedup over the original."""
    base = seconds["original"]
    out = {}
    for name, s in seconds.items():
        row = {"tokens_per_s": tokens / s, "speedup_vs_original": base / s}
        row["ms" if kind == "prefill" else "ms_per_token"] = s * 1e3
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if CUDA exists")
    parser.add_argument("--quick", action="store_true", help="tiny model and settings")
    parser.add_argument("--configs", default=None, help=f"comma-separated subset of {sorted(CONFIGS)}")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: steadier)")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/bench_generate-<device>.json)")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    settings = SETTINGS["quick" if args.quick else device]
    names = args.configs.split(",") if args.configs else (list(CONFIGS) if device == "cuda" else ["gpt2-small"])
    if args.quick:
        names = names[:1]
    started = time.time()
    report = {
        "meta": {
            "script": "scripts/bench_generate.py",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads() if device == "cpu" else None,
            "torch": torch.__version__,
            "settings": settings,
            "mode": "quick" if args.quick else "full",
        },
        "results": [],
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"bench_generate-{device}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["meta"]["seconds"] = round(time.time() - started, 1)
        out.write_text(json.dumps(report, indent=1) + "\n")

    for name in names:
        report["results"].append({})
        bench_config(name, device, dtype, settings, args.quick, report["results"][-1], save)
        save()
    print(f"wrote {out} ({report['meta']['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
