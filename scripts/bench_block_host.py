"""Host time of a GPT-2 block's forward (and the final norm) three ways, on CPU, Triton launch stubbed.

    python scripts/bench_block_host.py --out benchmarks/results/bench_block_host.json

* ``stock``: transformers' GPT-2 block with its LayerNorms (what the original model runs).
* ``rmsnorm``: the converted block (normswap's RMSNorm class), unpatched.
* ``patched``: the converted block after ``normswap.kernels.patch`` (what ``normswap.load``
  returns), with the kernel path forced on CPU and the Triton launch replaced by a no-op, so
  what is timed is normswap's Python around the launch (module forward, fusion hand-off, argument
  checks, plan look-up, allocations).

Rows: µs per block call and per final-norm call at decode shapes (batch 1 and 32, one token),
and per token for a 12-block model (12 blocks + final norm, divided by the batch). The
``norm_only`` rows time the norm module's call by itself, which is where the three differ.
bf16, one CPU thread; the tensors are this small so compute is a few µs at most.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
from bench_kernels import _host_us  # scripts/ is the script's first path entry


def _models(n_embd: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    import normswap

    cfg = GPT2Config(n_layer=1, n_embd=n_embd, n_head=n_embd // 64, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    stock = GPT2LMHeadModel(cfg).eval().to(torch.bfloat16)
    converted = normswap.convert_model(GPT2LMHeadModel(cfg).eval()).to(torch.bfloat16).eval()
    patched = normswap.convert_model(GPT2LMHeadModel(cfg).eval()).to(torch.bfloat16).eval()
    normswap.patch(patched)
    return stock, converted, patched


def run(calls: int) -> list[dict]:
    from normswap.kernels.ops import launch
    from normswap.kernels.ops import rms_norm as rms_norm_mod

    rows = []
    stock, converted, patched = _models(768)
    real_launch, real_use = launch._launch, rms_norm_mod.use_kernels
    launch._launch = lambda plan, args: None
    rms_norm_mod.use_kernels = lambda t: True
    try:
        with torch.inference_mode():
            for batch in (1, 32):
                x = torch.randn(batch, 1, 768, dtype=torch.bfloat16)
                timings = {}
                for name, model in (("stock", stock), ("rmsnorm", converted), ("patched", patched)):
                    block, final = model.transformer.h[0], model.transformer.ln_f
                    timings[name] = {
                        "block_us": _host_us(lambda b=block, x=x: b(x), calls),
                        "final_norm_us": _host_us(lambda f=final, x=x: f(x), calls * 4),
                        "norm_only_us": _host_us(lambda n=block.ln_1, x=x: n(x), calls * 4),
                    }
                for name, t in timings.items():
                    per_token = (12 * t["block_us"] + t["final_norm_us"]) / batch
                    rows.append({"impl": name, "batch": batch, "N": 768, "dtype": "bf16", **t,
                                 "model12_us_per_token": per_token,
                                 "vs_stock": per_token / ((12 * timings["stock"]["block_us"]
                                                           + timings["stock"]["final_norm_us"]) / batch)})
    finally:
        launch._launch, rms_norm_mod.use_kernels = real_launch, real_use
        launch.clear_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.calls)
    for r in rows:
        print(f"{r['impl']:8s} batch {r['batch']:2d}: block {r['block_us']:7.1f} us  final norm "
              f"{r['final_norm_us']:6.1f} us  norm {r['norm_only_us']:6.1f} us  "
              f"{r['model12_us_per_token']:7.1f} us/token  x{r['vs_stock']:.3f} stock")
    if args.out:
        doc = {"script": "scripts/bench_block_host.py", "calls": args.calls, "torch": torch.__version__,
               "device": platform.processor() or platform.machine(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
