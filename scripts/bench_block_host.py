"""Host time of a GPT-2 block's forward (and the final norm) three ways, on CPU, Triton launch stubbed.

    python scripts/bench_block_host.py --out benchmarks/results/bench_block_host.json

* ``stock``: transformers' GPT-2 block with its LayerNorms (what the original model runs).
* ``rmsnorm``: the converted block (normswap's RMSNorm class), unpatched.
* ``patched``: the converted block after ``normswap.kernels.patch`` (what ``normswap.load``
  returns), with the kernel path forced on CPU and the Triton launch replaced by a no-op, so
  what is timed is normswap's Python around the launch (module forward, fusion hand-off, argument
  checks, plan look-up, allocations).

Rows: µs per block call and per final-norm call at decode shapes (batch 1 and 32, one token),
and per token for a 12-block model (12 blocks + final norm, divided by the batch).

* ``block_us``: the block's forward, timed in rounds alternating between the three models;
  ``block_minus_stock_us`` the median over rounds of its difference from the stock block's in the
  same round (a block is ~1.5 ms of CPU compute, so this is the figure that resolves µs). The
  patched block also computes the next norm (here ``ln_f``) through its end-of-block handoff.
* ``hollow_model12_us_per_token``: a 12-block model's layer loop and final norm with every
  block's attention and MLP replaced by pass-throughs (``_hollow``), per token: the blocks'
  forwards as host time only (module calls, norms, adds, the fused forwards' own Python and the
  handoffs from block to block), timed the same alternating way. The figure the host-cost goal
  is stated in: patched ≤ stock.
* ``norm_work_per_block_us``: only the norm calls and the residual adds feeding them, as one
  block makes them (``_norm_work``): where the three differ.
* ``norm_only_us``, ``final_norm_us``: a norm module's call by itself.
* ``breakdown`` (patched): where one norm call's time goes, each figure one layer more than the
  last: ``empty_like`` (the floor: one allocation), ``plan_run`` (the cached plan: allocations,
  the argument tuple, the stubbed launch), ``module_rms_norm`` (plus the plan look-up: the
  module's weight, bias and eps, the call's key), ``module_call`` (plus ``nn.Module.__call__``
  and the patched forward's handoff check).

bf16, one CPU thread; the tensors are this small so compute is a few µs at most.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_kernels import _host_us  # scripts/ is the script's first path entry


def _models(n_embd: int, hollow: bool = False, n_layer: int = 1):
    from transformers import GPT2Config, GPT2LMHeadModel

    import normswap

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 64, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    stock = GPT2LMHeadModel(cfg).eval().to(torch.bfloat16)
    converted = normswap.convert_model(GPT2LMHeadModel(cfg).eval()).to(torch.bfloat16).eval()
    patched = normswap.convert_model(GPT2LMHeadModel(cfg).eval()).to(torch.bfloat16).eval()
    models = _hollow((stock, converted, patched)) if hollow else (stock, converted, patched)
    normswap.patch(patched)
    return models


class _PassAttention(torch.nn.Module):
    """A stand-in for a block's attention: its input back, no weights."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states, None


def _hollow(models):
    """The models with their blocks' attention and MLP replaced by pass-throughs, norms and adds
    kept: a block's forward is then host time only, the same for all three."""
    for model in models:
        for block in model.transformer.h:
            block.attn, block.mlp = _PassAttention(), torch.nn.Identity()
    return models


def _stack(model, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The model's layer loop and final norm on ``x``, as ``GPT2Model.forward`` runs them."""
    blocks, final = list(model.transformer.h), model.transformer.ln_f

    def run():
        h = x
        for block in blocks:
            h = block(h)
        return final(h)

    return run


def _interleaved_us(calls_by_name: dict[str, Callable[[], object]], calls: int,
                    rounds: int = 21) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Median µs per call of each, timed in alternating rounds of ``calls`` calls, and the median
    over rounds of each one's difference from the first's in the same round: the machine's drift
    (a block is ~1.5 ms of compute here) falls on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in calls_by_name}
    for call in calls_by_name.values():
        for _ in range(3):
            call()
    for _ in range(rounds):
        for name, call in calls_by_name.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    first = samples[next(iter(samples))]
    return ({name: statistics.median(values) for name, values in samples.items()},
            {name: statistics.median(v - f for v, f in zip(values, first, strict=True)) for name, values in samples.items()})  # fmt: skip


def _norm_work(name: str, model, x: torch.Tensor) -> Callable[[], object]:
    """The norm calls and the residual adds feeding them of one block, as the block makes them
    (its attention and MLP outputs stood in by ``x``): stock and unpatched, ln_1, the add, ln_2,
    the add; patched, the fused ln_2 add, the fused end-of-block add (which computes the next
    norm, here ln_f) and the next norm's call taking that result."""
    from normswap.kernels import fusion

    block, final = model.transformer.h[0], model.transformer.ln_f
    if name != "patched":
        def work():
            s = x + block.ln_1(x)
            return s + block.ln_2(s)
        return work

    def work():
        normed, s = fusion.add_norm(block.ln_2, x, x)
        return final(fusion.end_add(block, normed, s))
    return work


def _breakdown(norm, x: torch.Tensor, calls: int) -> dict[str, float]:
    """Where a patched norm's call spends its time: each figure adds one layer to the last."""
    from normswap.kernels.ops import rms_norm as rms_norm_mod

    out = {"empty_like_us": _host_us(lambda: torch.empty_like(x), calls * 4)}
    plans = norm.__dict__.get(getattr(rms_norm_mod, "_EAGER_PLANS", None), {})
    if plans:  # the cached plan alone: allocations, argument tuple, (stubbed) launch
        plan, weight, bias = next(iter(plans.values())), norm.weight, norm.bias
        out["plan_run_us"] = _host_us(lambda: plan.run(x, weight, bias, None), calls * 4)
    out["module_rms_norm_us"] = _host_us(lambda: rms_norm_mod.module_rms_norm(norm, x), calls * 4)
    out["module_call_us"] = _host_us(lambda: norm(x), calls * 4)
    return out


def run(calls: int) -> list[dict]:
    from normswap.kernels.ops import launch
    from normswap.kernels.ops import rms_norm as rms_norm_mod

    rows = []
    stock, converted, patched = _models(768)
    hollow_models = _models(768, hollow=True, n_layer=12)
    real_launch, real_use = launch._launch, rms_norm_mod.use_kernels
    launch._launch = lambda plan, args: None
    rms_norm_mod.use_kernels = lambda t: True
    try:
        with torch.inference_mode():
            for batch in (1, 32):
                x = torch.randn(batch, 1, 768, dtype=torch.bfloat16)
                timings = {}
                models = {"stock": stock, "rmsnorm": converted, "patched": patched}
                hollows = dict(zip(models, hollow_models, strict=True))
                blocks, over_stock = _interleaved_us({name: functools.partial(m.transformer.h[0], x) for name, m in models.items()},
                                                     calls // 10)  # fmt: skip
                hollow, _ = _interleaved_us({name: _stack(m, x) for name, m in hollows.items()}, calls // 10)
                for name, model in models.items():
                    block, final = model.transformer.h[0], model.transformer.ln_f
                    timings[name] = {
                        "block_us": blocks[name],
                        "block_minus_stock_us": over_stock[name],
                        "hollow_model12_us_per_token": hollow[name] / batch,
                        "final_norm_us": _host_us(lambda f=final, x=x: f(x), calls * 4),
                        "norm_only_us": _host_us(lambda n=block.ln_1, x=x: n(x), calls * 4),
                        "norm_work_per_block_us": _host_us(_norm_work(name, model, x), calls * 4),
                    }
                    if name == "patched":
                        timings[name]["breakdown"] = _breakdown(block.ln_1, x, calls)
                stock_t = timings["stock"]
                for name, t in timings.items():
                    per_token = (12 * t["block_us"] + t["final_norm_us"]) / batch
                    rows.append({"impl": name, "batch": batch, "N": 768, "dtype": "bf16", **t,
                                 "model12_us_per_token": per_token,
                                 "vs_stock": per_token / ((12 * stock_t["block_us"] + stock_t["final_norm_us"]) / batch),
                                 "norm_work_vs_stock": t["norm_work_per_block_us"] / stock_t["norm_work_per_block_us"],
                                 "hollow_vs_stock": t["hollow_model12_us_per_token"] / stock_t["hollow_model12_us_per_token"]})
    finally:
        launch._launch, rms_norm_mod.use_kernels = real_launch, real_use
        launch.clear_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per timing round of a norm; a tenth of it per round of a block")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # the stubbed launch leaves the patched norms' outputs as allocated (whatever bytes the
    # allocator hands back): flushing denormals keeps the attention and MLP on them from running
    # at denormal speed, which would be charged to the patched block
    torch.set_flush_denormal(True)
    rows = run(args.calls)
    for r in rows:
        print(f"{r['impl']:8s} batch {r['batch']:2d}: block {r['block_us']:7.1f} us "
              f"({r['block_minus_stock_us']:+5.1f} stock)  hollow 12 blocks {r['hollow_model12_us_per_token']:6.1f} "
              f"us/token (x{r['hollow_vs_stock']:.2f} stock)  final norm "
              f"{r['final_norm_us']:6.1f} us  norm {r['norm_only_us']:6.1f} us  norm work/block "
              f"{r['norm_work_per_block_us']:6.1f} us (x{r['norm_work_vs_stock']:.2f} stock)  "
              f"{r['model12_us_per_token']:7.1f} us/token  x{r['vs_stock']:.3f} stock")
        if "breakdown" in r:
            print("         breakdown: " + "  ".join(f"{k} {v:.2f}" for k, v in r["breakdown"].items()))
    if args.out:
        doc = {"script": "scripts/bench_block_host.py", "calls": args.calls, "torch": torch.__version__,
               "device": platform.processor() or platform.machine(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
