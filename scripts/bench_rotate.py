"""What rotating the residual basis buys: activation outliers and round-to-nearest weight quantisation.

For one model (default: the bundled Austen GPT-2), side by side in one run:

* the original LayerNorm model, its exact gain-folded RMSNorm conversion (no rotation), and its
  rotations (``hadamard`` and ``orthogonal`` for several seeds, ``pca`` on calibration text);
* for each: held-out strided perplexity in float32; the outlier ratio max|x|/RMS(x) and kurtosis
  at every linear layer's input (the stream readers and the MLP down projections apart); and the
  perplexity and KL after RTN fake quantisation (symmetric): weight-only per output channel at
  int8, int4 and int4 with groups of 128, and W8A8 / W4A8 (weights per channel, every linear
  layer's input per token at 8 bits), applied to every linear layer of the residual blocks
  (embeddings and head stay in float32);
* the rotations in both forms: ``free`` (the RMSNorm model, own model type) and ``commuting``
  (Q·1 = 1, the stock class); and the free Hadamard rotation with QuaRot's online Hadamard at the
  down projections' input (``rotate --form free --online-hadamard``, verified like the others);
* per quantiser, the fraction of the original's perplexity gap that each model closes:
  (ppl_q(original) - ppl_q(model)) / (ppl_q(original) - ppl(original)).

Writes JSON to benchmarks/results/bench_rotate.json and prints Markdown tables.

With ``--slicing``, instead: the perplexity cost of ``rotate --slice`` at each ``--fractions``
(default 0.1 0.2 0.3), side by side with the unsliced model, plus the mean KL(original ‖ sliced)
per token and the share of parameters kept; JSON to benchmarks/results/bench_rotate-slicing.json
(``-synthetic-slicing.json`` with ``--synthetic``).

    python3 scripts/bench_rotate.py [--model normswap:austen-gpt2] [--seeds 0 1 2] [--eval-tokens N]
    python3 scripts/bench_rotate.py --slicing [--synthetic] [--fractions 0.1 0.2 0.3]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import normswap  # noqa: E402
from normswap.analysis.outliers import (  # noqa: E402
    linear_input_outliers,
    mark_stream_readers,
    plot_outliers,
    summarise,
    summarise_groups,
)
from normswap.api import rotate_checkpoint  # noqa: E402
from normswap.architectures import architecture_for  # noqa: E402
from normswap.checkpoint.source import read_config, resolve_source  # noqa: E402
from normswap.evaluation.perplexity import strided_perplexity  # noqa: E402
from normswap.rotate.quantise import QUANTISERS, apply_quantiser, is_down_projection  # noqa: E402
from normswap.rotate.slice_pipeline import SliceOptions, slice_checkpoint  # noqa: E402
from normswap.runtime.reference import tokenize_text  # noqa: E402

BUNDLED_TEXT = ROOT / "normswap" / "data" / "text"
QUANTISATIONS = QUANTISERS
GAIN_OUTLIERS = (11, 101)  # the synthetic model's norm-gain outlier channels


STRIDE = {"value": None}


def perplexity(model, ids: torch.Tensor, window: int) -> float:
    with torch.no_grad():
        return strided_perplexity(model, ids, max_length=window, stride=STRIDE["value"] or window,
                                  batch_size=4).token_perplexity


@torch.no_grad()
def _logits(model, ids: torch.Tensor, window: int) -> torch.Tensor:
    full = ids.numel() // window * window
    return model(input_ids=ids[:full].reshape(-1, window)).logits.double()


def measure(name: str, load, ids: torch.Tensor, outlier_ids: torch.Tensor, window: int, blocks: str) -> dict:
    """Perplexity, outliers (stream readers and MLP down projections apart), and per quantisation the
    perplexity and mean KL(unquantised ‖ quantised) over the outlier tokens (KL isolates what
    quantisation changes, also where perplexity means little)."""
    model = load()
    row = {"model": name, "perplexity": perplexity(model, ids, window)}
    layers = linear_input_outliers(model, outlier_ids, seq_len=window)
    mark_stream_readers(model, layers)  # the family's adapter names the layers that read a norm
    row["outliers"] = {**summarise_groups(layers), "layers": layers,
                       "down_projections": summarise([layer for layer in layers if is_down_projection(layer["layer"])])}
    reference = torch.log_softmax(_logits(model, outlier_ids, window), -1)
    del model
    for label in QUANTISATIONS:
        quantised = load()
        row["quantised_layers"] = apply_quantiser(quantised, label, within=blocks)
        row[f"perplexity_{label}"] = perplexity(quantised, ids, window)
        candidate = torch.log_softmax(_logits(quantised, outlier_ids, window), -1)
        row[f"kl_{label}"] = float((reference.exp() * (reference - candidate)).sum(-1).mean())
        del quantised
    print(f"  {name}: ppl {row['perplexity']:.3f}, int4 {row['perplexity_int4']:.3f}, "
          f"W4A8 {row['perplexity_W4A8']:.3f}", flush=True)
    return row


def synthetic_model(directory: Path, tokenizer_dir: Path, *, d: int = 256, layers: int = 4, seed: int = 0) -> Path:
    """A random GPT-2 made to look trained where it matters here: norm gains far from 1 with two
    outlier channels (γ 20× the rest, as trained LayerNorms have: Kovaleva et al. 2021, Wei et al.
    2022), biases far from 0, and one massive residual dimension (a few coordinates hundreds of
    times the RMS, as trained GPT-2, OPT and Pythia have), built by a large constant in the token
    table and in every MLP output bias on that dimension. Its perplexity is meaningless; the KL
    between it and its quantised copy is not."""
    import shutil

    import transformers

    generator = torch.Generator().manual_seed(seed)
    # weights 5x GPT-2's initial scale, so that the logits vary from token to token as a trained
    # model's do (at GPT-2's init they are nearly uniform and no weight change can move them)
    config = transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=d // 64, vocab_size=2048, n_positions=256,
                                     bos_token_id=0, eos_token_id=0, initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    massive = 7
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + 1.5 * torch.rand(d, generator=generator))
                module.weight[list(GAIN_OUTLIERS)] *= 20.0
                module.bias.copy_(0.2 * torch.randn(d, generator=generator))
        model.transformer.wte.weight[:, massive] += 3.0
        for block in model.transformer.h:
            block.mlp.c_proj.bias[massive] += 6.0
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="normswap:austen-gpt2")
    parser.add_argument("--synthetic", action="store_true",
                        help="measure a random GPT-2 with a massive residual dimension instead (see synthetic_model)")
    parser.add_argument("--eval-text", type=Path, default=BUNDLED_TEXT / "persuasion-excerpt.txt",
                        help="held-out text for perplexity (default: the bundled Persuasion excerpt)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="pca calibration text (default: shared/data/austen/emma.txt if present, else the "
                             "bundled Emma excerpt); must not be the evaluation text")
    parser.add_argument("--eval-tokens", type=int, default=None, help="score only the first N tokens (default all)")
    parser.add_argument("--stride", type=int, default=None, help="perplexity stride (default: the window)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--outlier-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_rotate.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "results" / "bench_rotate-outliers.png")
    parser.add_argument("--slicing", action="store_true", help="measure the perplexity cost of --slice instead")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    calibration = args.calibration
    if calibration is None:
        shared = ROOT.parent / "shared" / "data" / "austen" / "emma.txt"
        calibration = shared if shared.is_file() else BUNDLED_TEXT / "emma-excerpt.txt"

    keep = tempfile.TemporaryDirectory()
    if args.synthetic:
        args.model = "synthetic GPT-2 (d=256, 4 layers, massive dimension)"
        source = synthetic_model(Path(keep.name) / "synthetic", ROOT / "normswap" / "data" / "austen-gpt2")
    else:
        source = resolve_source(args.model)
    config = read_config(source)
    architecture = architecture_for(config)
    model, tokenizer = normswap.load_model(source)
    window = min(getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", 1024),
                 1024)
    ids = tokenize_text(tokenizer, args.eval_text.read_text())[: args.eval_tokens]
    STRIDE["value"] = args.stride
    outlier_ids = ids[: args.outlier_tokens]
    del model
    if args.slicing:
        return slicing_curve(args, source, calibration, ids, outlier_ids, window, architecture.blocks)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        print(f"{args.model}: {ids.numel()} evaluation tokens, window {window}", flush=True)
        rows.append(measure("original", lambda: normswap.load_model(source)[0], ids, outlier_ids, window,
                            architecture.blocks))
        folded = scratch / "folded"
        normswap.convert_checkpoint(source, folded, fold_gains=True, verification="none")
        rows.append(measure("folded (no rotation)", lambda: normswap.load(folded), ids, outlier_ids, window,
                            architecture.blocks))
        runs = [(method, seed) for method in ("hadamard", "orthogonal") for seed in args.seeds] + [("pca", None)]
        for form in ("free", "commuting"):
            for method, seed in runs:
                rows.append(rotated_row(source, scratch, form, method, seed, calibration, ids, outlier_ids, window,
                                        architecture.blocks))
        # QuaRot's online Hadamard at the down projections' input: rotate --form free --online-hadamard
        rows.append(rotated_row(source, scratch, "free", "hadamard", args.seeds[0], calibration, ids, outlier_ids,
                                window, architecture.blocks, online_hadamard=True))
    elapsed = time.perf_counter() - started

    for row in rows:
        row.update({f"{label}_gap_closed": _closed(rows[0], row, f"perplexity_{label}") for label in QUANTISATIONS})

    print_tables(rows)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": args.model, "eval_text": args.eval_text.name, "eval_tokens": int(ids.numel()), "window": window,
        "stride": args.stride or window,
        "calibration": calibration.name, "outlier_tokens": int(outlier_ids.numel()),
        "quantisation": "RTN, symmetric: weights per output channel (int4-g128: per group of 128 inputs); W8A8/W4A8 "
                        "also every linear layer's input per token at 8 bits; every linear layer of the residual "
                        "blocks; embeddings and head in float32",
        "seconds": elapsed, "torch": torch.__version__, "machine": platform.machine(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(_finite(payload), indent=1) + "\n")
    plot_outliers({row["model"]: row["outliers"]["layers"] for row in rows
                   if row["model"] in ("original", "folded (no rotation)", "free hadamard seed 0", "commuting hadamard seed 0",
                                       "free hadamard seed 0 + online Hadamard")},
                  args.plot)
    print(f"\nwrote {args.out} and {args.plot} ({elapsed:.0f} s)")
    return 0


def print_tables(rows: list[dict]) -> None:
    """Markdown: perplexity and KL per quantiser; outliers at stream readers and down projections."""
    labels = list(QUANTISATIONS)
    print("\n| model | ppl | " + " | ".join(labels) + " | " + " | ".join(f"KL {label}" for label in labels) + " |")
    print("|---|---|" + "---|" * (2 * len(labels)))
    for row in rows:
        print(f"| {row['model']} | {row['perplexity']:.2f} | "
              + " | ".join(f"{row[f'perplexity_{label}']:.2f}" for label in labels) + " | "
              + " | ".join(f"{row[f'kl_{label}']:.2e}" for label in labels) + " |")
    print("\n| model | outlier ratio, stream readers (mean / max) | kurtosis, stream readers | outlier ratio, "
          "down projections | kurtosis, down projections |")
    print("|---|---|---|---|---|")
    for row in rows:
        cells = [f"{part['outlier_ratio_mean']:.1f} / {part['outlier_ratio_max']:.1f} | "
                 f"{part['kurtosis_mean']:.1f} / {part['kurtosis_max']:.1f}"
                 for part in (row["outliers"]["stream_readers"], row["outliers"]["down_projections"])]
        print(f"| {row['model']} | {cells[0]} | {cells[1]} |")


def rotated_row(source: Path, scratch: Path, form: str, method: str, seed: int | None, calibration: Path,
                ids: torch.Tensor, outlier_ids: torch.Tensor, window: int, blocks: str, *,
                online_hadamard: bool = False) -> dict:
    """Rotate ``source`` (verified) in ``form`` and measure it; the free form loads as the RMSNorm
    model (with ``online_hadamard``, H at its down projections' input), the commuting form through
    the stock class."""
    out = scratch / (f"{form}-{method}-{seed}" + ("-online" if online_hadamard else ""))
    block = rotate_checkpoint(source, out, method=method, seed=seed or 0, form=form, verification="full",
                              calibration=calibration if method == "pca" else None, online_hadamard=online_hadamard)
    assert block["verification"]["passed"]
    name = f"{form} {method}" + ("" if seed is None else f" seed {seed}") + (" + online Hadamard" if online_hadamard else "")
    row = measure(name, lambda: normswap.load(out), ids, outlier_ids, window, blocks)
    row["rotation"] = {key: block["rotation"][key] for key in ("form", "method", "seed", "matrix_sha256")}
    row["verification_max_abs_diff"] = max(figures["max_abs_diff"] for figures in block["verification"]["loaders"].values()
                                           if "max_abs_diff" in figures)
    return row


def _parameters(path: Path, under: str = "") -> int:
    """Parameters in the checkpoint (those whose names start with ``under``)."""
    from normswap.checkpoint.source import CheckpointReader

    with CheckpointReader(path) as reader:
        return sum(math.prod(info.shape) for name, info in reader.tensors.items() if name.startswith(under))


def slicing_curve(args, source: Path, calibration: Path, ids: torch.Tensor, kl_ids: torch.Tensor, window: int,
                  blocks: str) -> int:
    """Perplexity and KL(original ‖ sliced) of the original and of each slice fraction, one run.

    Parameters are counted whole (a sliced checkpoint stores its head untied, V×k) and within the
    residual blocks (shortcut matrices included), which is what slicing shrinks."""
    started = time.perf_counter()
    original = normswap.load_model(source)[0]
    reference = torch.log_softmax(_logits(original, kl_ids, window), -1)
    rows = [{"model": "original (unsliced)", "fraction": 0.0, "hidden_size": original.config.hidden_size,
             "perplexity": perplexity(original, ids, window), "kl": 0.0, "parameters": _parameters(source),
             "block_parameters": _parameters(source, blocks + ".")}]
    del original
    print(f"{args.model}: {ids.numel()} evaluation tokens, window {window}; calibration {calibration.name}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for fraction in args.fractions:
            out = Path(scratch) / f"slice-{fraction}"
            block = slice_checkpoint(source, out, SliceOptions(fraction, calibration,
                                                               held_out=args.eval_text))["slicing"]
            model = normswap.load(out).eval()
            candidate = torch.log_softmax(_logits(model, kl_ids, window), -1)
            rows.append({"model": f"sliced {fraction}", "fraction": fraction, "hidden_size": block["hidden_size"],
                         "perplexity": perplexity(model, ids, window),
                         "kl": float((reference.exp() * (reference - candidate)).sum(-1).mean()),
                         "parameters": _parameters(out), "block_parameters": _parameters(out, blocks + "."),
                         "energy_kept": block["energy_kept"],
                         "command_report": block["perplexity"]})
            del model
    elapsed = time.perf_counter() - started
    print("\n| model | hidden size | parameters | block parameters | ppl | ppl / unsliced | KL(original ‖ sliced) | stream energy kept (mean / min) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        energy = row.get("energy_kept")
        kept = f"{energy['mean']:.2%} / {energy['min']:.2%}" if energy else "100% / 100%"
        print(f"| {row['model']} | {row['hidden_size']} | {row['parameters'] / rows[0]['parameters']:.1%} | "
              f"{row['block_parameters'] / rows[0]['block_parameters']:.1%} | "
              f"{row['perplexity']:.3f} | {row['perplexity'] / rows[0]['perplexity']:.3f} | {row['kl']:.3g} | {kept} |")
    out = args.out
    if out == ROOT / "benchmarks" / "results" / "bench_rotate.json":
        out = out.with_name("bench_rotate-synthetic-slicing.json" if args.synthetic else "bench_rotate-slicing.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": args.model, "eval_text": args.eval_text.name, "eval_tokens": int(ids.numel()),
               "kl_tokens": int(kl_ids.numel()), "window": window, "calibration": calibration.name,
               "seconds": elapsed, "torch": torch.__version__, "machine": platform.machine(), "rows": rows}
    out.write_text(json.dumps(_finite(payload), indent=1) + "\n")
    print(f"\nwrote {out} ({elapsed:.0f} s)")
    return 0


def _closed(original: dict, row: dict, key: str) -> float:
    gap = original[key] - original["perplexity"]
    return (original[key] - row[key]) / gap if gap else float("nan")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
