"""``normswap geometry MODEL [--compare CONVERTED] [--out DIR [--plot]] [--json]``: how a model's norm inputs use the all-ones direction."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import normswap
from normswap.analysis import DEFAULT_TEXT
from normswap.commands import (
    add_device_option,
    add_progress_option,
    add_report_options,
    at_least,
    check_device,
    check_report_out,
    check_source,
    command_inputs,
    emit_json,
    json_text,
    quiet_progress_bars,
    resolve_device,
    write_reports,
)
from normswap.errors import NormswapError

if TYPE_CHECKING:  # torch is imported once the arguments are checked
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
# A token is rarely longer than this many characters; reading only that much keeps huge files cheap.
_CHARS_PER_TOKEN = 16


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model to measure: hub id, local directory or normswap:austen-gpt2")
    parser.add_argument("--compare", metavar="CONVERTED",
                        help="also measure this (converted) model on the same tokens and print both side by side")
    parser.add_argument("--text", type=_text_file, default=None,
                        help=f"text file to run the model on, or 'bundled' (the default: the bundled excerpt "
                             f"{DEFAULT_TEXT.name})")
    parser.add_argument("--random-tokens", action="store_true",
                        help="use uniformly random token ids instead of text (for models without a tokenizer)")
    parser.add_argument("--audio", metavar="PATH",
                        help="speech models (Whisper): audio folder with .txt transcripts, JSONL manifest, or "
                             "'bundled'; the encoder reads the audio, the decoder its transcript")
    parser.add_argument("--images", metavar="PATH",
                        help="vision models (ViT, CLIP): image folder (class subfolders as labels) or 'bundled'")
    parser.add_argument("--max-tokens", type=at_least(1, 10**8), default=4096,
                        help="number of tokens to measure (default 4096)")
    parser.add_argument("--seq-len", type=at_least(2), default=None,
                        help="window length (default: the model's context length, at most 1024)")
    parser.add_argument("--batch-size", type=at_least(1), default=4, help="windows per forward pass (default 4)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                        help="dtype to run the model in; statistics are always float64 (default float32)")
    add_device_option(parser)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load a model whose type transformers lacks with its own code (auto_map); "
                             "converted checkpoints always load with normswap's classes, never their code")
    parser.add_argument("--top-dims", type=at_least(1), default=5, help="dimensions listed per norm as carrying the mean")
    parser.add_argument("--seed", type=at_least(0, 2**63 - 1), default=0, help="seed for --random-tokens")
    add_report_options(parser)
    add_progress_option(parser)
    parser.add_argument("--outliers", action="store_true",
                        help="also measure max|x|/RMS(x) and kurtosis at every linear layer's input (the MLP "
                             "down projections apart) and the KL that round-to-nearest quantisation costs (weight-only "
                             "int8/int4/int4-g128, W8A8, W4A8): what a rotation changes; with --plot, also "
                             "report-outliers.png")


def _text_file(spec: str) -> Path:
    from normswap.evaluation.text import text_file

    return text_file(spec)


def read_text(path: Path, max_chars: int) -> str:
    """The first ``max_chars`` characters of a UTF-8 text file; one-line error if unreadable or empty."""
    from normswap.evaluation.text import read_text_file

    text = read_text_file(path, max_chars)
    if not text.strip():
        raise NormswapError(f"text file is empty: {path}")
    return text


def token_ids(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int | None) -> tuple[torch.Tensor, str]:
    """The 1-D token ids to measure on, and a description of where they came from."""
    import torch

    if args.random_tokens:
        if not vocab_size:
            raise NormswapError("--random-tokens needs the model's vocab_size, which its config does not give")
        generator = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab_size, (args.max_tokens,), generator=generator), f"random ids (seed {args.seed})"
    path = args.text or DEFAULT_TEXT
    text = read_text(path, args.max_tokens * _CHARS_PER_TOKEN)
    if tokenizer is None:
        raise NormswapError(f"{args.model} has no tokenizer; pass --random-tokens to measure on random token ids")
    # the text is longer than the model's context on purpose: it is cut into windows below
    from normswap.checkpoint.tokenizer_panics import tokenized

    # a panic of the tokenizer's regex is one line, and its time is bounded
    encoded = tokenized(Path(getattr(tokenizer, "name_or_path", "") or "."), lambda: tokenizer(text, verbose=False),
                        len(text))
    ids = torch.tensor(encoded["input_ids"][: args.max_tokens], dtype=torch.long)
    if ids.numel() < 2:
        raise NormswapError(f"{path} gives fewer than 2 tokens")
    return ids, str(path)


def _dtype(name: str) -> torch.dtype:
    from normswap.dtypes import parse_dtype

    return parse_dtype(name)


def _load(src: str, args: argparse.Namespace):
    model, tokenizer = normswap.load_model(src, dtype=_dtype(args.dtype), trust_remote_code=args.trust_remote_code)
    return model.to(resolve_device(args.device)), tokenizer


def measure(src: str, model: PreTrainedModel, ids: torch.Tensor, text: str, args: argparse.Namespace) -> dict:
    """Run one model over ``ids`` and build its report."""
    from normswap.analysis.collect import run_geometry
    from normswap.analysis.report import build_report

    seq_len = args.seq_len or 1024
    norms = run_geometry(model, ids, seq_len=seq_len, batch_size=args.batch_size, top_dims=args.top_dims)
    return build_report(norms, model=src, dtype=_dtype(args.dtype), tokens=int(ids.numel()), text=text)


def _media_reports(args: argparse.Namespace) -> tuple[dict, None]:
    """Reports on audio or images: the inputs are prepared once, by the first model's own processor."""
    from normswap.analysis.collect import run_geometry_on
    from normswap.analysis.report import build_report
    from normswap.checkpoint.source import read_config
    from normswap.evaluation import audio, media
    from normswap.evaluation.media_eval import check_sources
    from normswap.runtime.reference import load_tokenizer

    kind = "audio" if args.audio else "images"
    spec = args.audio or args.images
    (audio.check_audio if kind == "audio" else media.check_images)(spec)
    sources = [args.model] + ([args.compare] if args.compare else [])
    paths = check_sources(sources, kind, args.trust_remote_code)
    if kind == "audio":
        from normswap.evaluation import speech as task
    else:
        from normswap.evaluation import vision as task
    data = task.prepare(paths[0], spec, load_tokenizer(paths[0]), read_config(paths[0]))
    reports = {}
    for label, source in zip(("original", "converted"), sources, strict=False):
        model, _ = _load(source, args)
        norms = run_geometry_on(model, task.geometry_batches(model, data, args.batch_size), top_dims=args.top_dims)
        reports[label] = build_report(norms, model=source, dtype=_dtype(args.dtype),
                                      tokens=max(n["tokens"] for n in norms), text=data.describe())
        del model
    return reports, None


def _text_reports(args: argparse.Namespace) -> tuple[dict, Callable[[], str] | None]:
    """Reports on text, and what measures the outlier statistics (``--outliers``) and returns their table."""
    from normswap.evaluation.media_eval import check_sources

    # Speech and vision models read audio or images: say so before loading anything.
    check_sources([args.model] + ([args.compare] if args.compare else []), None, args.trust_remote_code)

    model, tokenizer = _load(args.model, args)
    converted, converted_tokenizer = _load(args.compare, args) if args.compare else (None, None)
    vocab_size = getattr(model.config, "vocab_size", None)
    ids, text = token_ids(args, tokenizer if tokenizer is not None else converted_tokenizer, vocab_size)

    reports = {"original": measure(args.model, model, ids, text, args)}
    if converted is not None:
        reports["converted"] = measure(args.compare, converted, ids, text, args)
        reports["converted"]["rotated"] = "rotation" in (getattr(converted.config, "normswap", None) or {})
    if not args.outliers:
        return reports, None
    models = {"original": model, **({"converted": converted} if converted is not None else {})}
    return reports, lambda: _outliers(args, models, ids, reports)


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse contradictory or impossible options, with one line, before any model is loaded."""
    from normswap.extras import require

    if args.audio and args.images:
        raise NormswapError("pass --audio or --images, not both: a model reads one kind of input")
    if (args.audio or args.images) and (args.text is not None or args.random_tokens or args.outliers):
        raise NormswapError("--text, --random-tokens and --outliers are for text models; drop them with --audio/--images")
    if args.max_tokens < 2:
        raise NormswapError("--max-tokens must be at least 2")
    if args.text is not None and not args.random_tokens:
        from normswap.evaluation.text import check_text_file

        check_text_file(args.text)
    check_report_out(args, command_inputs(args))
    if args.plot:
        require("plot", "normswap geometry --plot")
    check_source(args.model, trust_remote_code=args.trust_remote_code)  # before any heavy import
    if args.compare:
        check_source(args.compare, trust_remote_code=args.trust_remote_code)
    check_device(args.device)
    from normswap.checkpoint.source import read_config, resolve_source

    sources = [args.model] + ([args.compare] if args.compare else [])
    paths = [resolve_source(src, trust_remote_code=args.trust_remote_code) for src in sources]
    configs = [read_config(path) for path in paths]
    if args.compare:
        from normswap.checkpoint import validation

        validation.check_same_shape(paths[0], configs[0], paths[1], configs[1])
    if args.seq_len is not None and not (args.audio or args.images):
        _check_seq_len(args.seq_len, sources, configs)


def _check_seq_len(seq_len: int, sources: list[str], configs: list[dict]) -> None:
    """A window longer than a model's context would be cut silently: refuse it instead."""
    from normswap.runtime.reference import config_context_length

    for source, config in zip(sources, configs, strict=True):
        context = config_context_length(config)
        if context is not None and seq_len > context:
            raise NormswapError(f"--seq-len {seq_len} is longer than the context of {source} ({context} tokens)")


def run(args: argparse.Namespace) -> int:
    quiet_progress_bars(args)
    _check_arguments(args)
    from normswap.analysis.report import format_comparison, format_report

    reports, outliers = _media_reports(args) if args.audio or args.images else _text_reports(args)
    original = reports["original"]
    converted = reports.get("converted")
    tables = [format_comparison(original, converted) if converted is not None else format_report(original)]
    if outliers is not None:
        tables.append(outliers())
    text = "\n".join(tables)
    print(text)
    payload = reports if converted is not None else original
    if args.out is not None:
        write_reports(args.out, lambda folder: _write_files(folder, payload, reports, text, args.plot),
                      inputs=command_inputs(args), overwrite=args.overwrite)
    if args.json:
        emit_json(args, payload)
    return 0


def _write_files(folder: Path, payload: dict, reports: dict, text: str, plot: bool) -> list[Path]:
    """report.json, report.md, and with ``plot`` report.png (and report-outliers.png) in ``folder``."""
    from normswap.analysis.report import to_markdown

    written = [folder / "report.json", folder / "report.md"]
    written[0].write_text(json_text(payload), encoding="utf-8")
    written[1].write_text(to_markdown(reports, text), encoding="utf-8")
    if plot:
        from normswap.analysis.plot import plot_reports

        written.append(plot_reports(reports, folder / "report.png"))
        from normswap.analysis.report import display_label

        layers = {display_label(label, report): report["outliers"]["layers"]
                  for label, report in reports.items() if "outliers" in report}
        if layers:
            from normswap.analysis.outliers import plot_outliers

            plot_outliers(layers, folder / "report-outliers.png")
            written.append(folder / "report-outliers.png")
    return written


def _outliers(args: argparse.Namespace, models: dict, ids: torch.Tensor, reports: dict) -> str:
    """Linear-input outlier statistics per model, added to each report; returns their table."""
    from normswap.analysis.outliers import format_outliers, geometry_outliers
    from normswap.analysis.report import display_label
    from normswap.runtime.reference import context_length

    seq_len = min([args.seq_len or 1024] + [context_length(model) for model in models.values()])
    results = geometry_outliers(models, ids, seq_len, args.batch_size)
    for label, result in results.items():
        reports[label]["outliers"] = result
    return format_outliers({display_label(label, reports[label]): result["summary"] for label, result in results.items()},
                           {display_label(label, reports[label]): result["quantisation_kl"]
                            for label, result in results.items()})
