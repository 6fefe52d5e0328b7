#!/usr/bin/env python
"""Geometry prediction vs end-to-end cost of a naive LayerNorm -> RMSNorm swap, for one model.

For MODEL (default: the bundled ``normswap:austen-gpt2``) and a text (default: the bundled held-out
excerpt), this script

1. measures the geometry at every norm input of the original and of its exact conversion
   (``normswap.convert_model``), as ``normswap geometry MODEL --compare CONVERTED`` does;
2. runs the original, the exact conversion and the naive conversion
   (``normswap.convert_model(method="naive")``: LayerNorm -> RMSNorm, nothing centred) over the same
   windows and reports perplexity, mean KL(original || candidate), top-1 agreement and max |Δlogit|;
3. prints both and writes everything as JSON (default ``benchmarks/results/geometry-<model>.json``).

Perplexity here is over non-overlapping windows of the model's context length, predicting positions
1..T-1 of each window; it is for comparing the three models with each other, not with other protocols.

Usage (from the repository root)::

    python scripts/geometry_report.py [--model normswap:austen-gpt2] [--text FILE] [--max-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import normswap  # noqa: E402
from normswap.analysis.collect import DEFAULT_TEXT, context_length, run_geometry, windows  # noqa: E402
from normswap.analysis.report import build_report, format_comparison  # noqa: E402


def end_to_end(reference, candidate, ids: torch.Tensor, seq_len: int) -> dict:
    """Perplexities of both models and mean KL / top-1 agreement / max |Δlogit| of candidate vs reference."""
    nll_ref = nll_cand = kl = agree = 0.0
    max_diff = 0.0
    predicted = positions = 0
    with torch.no_grad():
        for batch in windows(ids, seq_len, batch_size=4):
            if batch.shape[1] < 2:
                continue
            logits_a, logits_b = reference(input_ids=batch).logits, candidate(input_ids=batch).logits
            max_diff = max(max_diff, float((logits_a - logits_b).abs().max()))
            a, b = logits_a.double().log_softmax(-1), logits_b.double().log_softmax(-1)
            targets = batch[:, 1:, None]
            nll_ref -= float(a[:, :-1].gather(-1, targets).sum())
            nll_cand -= float(b[:, :-1].gather(-1, targets).sum())
            predicted += targets.numel()
            kl += float((a.exp() * (a - b)).sum())
            agree += float((a.argmax(-1) == b.argmax(-1)).sum())
            positions += a.shape[0] * a.shape[1]
    ppl_ref, ppl_cand = math.exp(nll_ref / predicted), math.exp(nll_cand / predicted)
    return {"perplexity_original": ppl_ref, "perplexity_candidate": ppl_cand,
            "perplexity_rel_change": ppl_cand / ppl_ref - 1, "mean_kl": kl / positions,
            "top1_agreement": agree / positions, "max_abs_logit_diff": max_diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="normswap:austen-gpt2")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    model, tokenizer = normswap.load_model(args.model, dtype=torch.float32)
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer")
    text = args.text.read_text(encoding="utf-8")[: args.max_tokens * 16]
    ids = torch.tensor(tokenizer(text)["input_ids"][: args.max_tokens])
    seq_len = min(context_length(model), 1024)
    exact = normswap.convert_model(model)
    naive = normswap.convert_model(model, method="naive")

    reports = {}
    for label, m in (("original", model), ("converted", exact)):
        norms = run_geometry(m, ids, seq_len=seq_len)
        reports[label] = build_report(norms, model=f"{args.model} ({label})", dtype=torch.float32,
                                      tokens=ids.numel(), text=str(args.text))
    print(format_comparison(reports["original"], reports["converted"]))

    outcomes = {"exact": end_to_end(model, exact, ids, seq_len), "naive": end_to_end(model, naive, ids, seq_len)}
    print(f"\nend to end on {ids.numel()} tokens ({seq_len}-token windows), against the original:")
    print(f"{'conversion':<10}  {'ppl orig':>9}  {'ppl conv':>9}  {'Δppl rel':>9}  {'mean KL':>9}  {'top-1':>7}  "
          f"{'max|Δlogit|':>11}")
    for label, r in outcomes.items():
        print(f"{label:<10}  {r['perplexity_original']:9.4f}  {r['perplexity_candidate']:9.4f}  "
              f"{r['perplexity_rel_change']:+9.2e}  {r['mean_kl']:9.2e}  {r['top1_agreement']:7.4f}  "
              f"{r['max_abs_logit_diff']:11.3g}")

    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"geometry-{args.model.replace(':', '-').replace('/', '-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"geometry": reports, "end_to_end": outcomes}, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
