"""``normswap eval MODEL [--baseline ORIG] [--out DIR [--plot]] [--json]``: perplexity and lm-eval scores, side by side.

Exit status: 0 when the comparison passes (or there is none), 3 when a tolerance is exceeded,
2 for user errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normswap.commands import (
    add_device_option,
    add_progress_option,
    add_report_options,
    check_report_out,
    check_source,
    command_inputs,
    emit_json,
    progress_off,
    quiet_progress_bars,
    resolve_device,
    tolerance,
    write_reports,
)
from normswap.errors import NormswapError, VerificationError

if TYPE_CHECKING:  # torch and lm-eval are imported once the arguments are checked
    from normswap.evaluation.compare import Tolerances
    from normswap.evaluation.runner import EvalSettings


def add_eval_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``eval`` and ``run``; all default to None (for ``run``: keep the recipe's)."""
    default = None
    group = parser.add_argument_group("evaluation settings (identical for both models)")
    group.add_argument("--dtype", default=default, help="weights and activations dtype (eval default: float32; run: the recipe's)")
    group.add_argument("--batch-size", type=int, default=default, help="fixed batch size (eval default: 8; run: the recipe's)")
    group.add_argument("--max-length", type=int, default=default,
                       help="tokens per window / lm-eval max length (default: the model's context)")
    add_device_option(group, default)
    group.add_argument("--device-map", default=default,
                       help="'auto' spreads a big model over all visible GPUs (accelerate)")
    group.add_argument("--limit", type=float, default=default,
                       help="at most this many documents per lm-eval task (quick checks only)")
    group.add_argument("--threads", type=int, default=default,
                       help="CPU threads for the forward passes (default: the cores idle at the start)")
    group.add_argument("--plain-lm-eval", action="store_true", default=default,
                       help="score with lm-eval's own HFLM path, without running a shared context once "
                            "for all its choices (same scores, slower)")
    group.add_argument("--one-at-a-time", action="store_true", default=default,
                       help="score the baseline and the model one after the other (default on a CPU with two "
                            "or three idle cores: side by side, the baseline on one core)")
    group.add_argument("--trust-remote-code", action="store_true", default=default,
                       help="load a model whose type transformers lacks with its own code (auto_map); "
                            "converted checkpoints always load with normswap's classes, never their code")
    media = parser.add_argument_group("speech and vision models (instead of text)")
    media.add_argument("--audio", metavar="PATH", default=default,
                       help="Whisper: a folder of audio files with same-stem .txt transcripts, a JSONL manifest "
                            "of {\"audio\": FILE, \"text\": ...}, or 'bundled'")
    media.add_argument("--images", metavar="PATH", default=default,
                       help="ViT, CLIP: a folder of images, class subfolders as labels, or 'bundled'")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint to evaluate: local dir, hub id, or normswap:austen-gpt2")
    parser.add_argument("--baseline", help="the original checkpoint; evaluate both and compare")
    parser.add_argument("--text", help="perplexity text: FILE, DIR of .txt, 'bundled' (default) or wikitext-2-raw-v1")
    parser.add_argument("--stride", type=int, help="strided perplexity stride in tokens (default: --max-length)")
    parser.add_argument("--no-perplexity", action="store_true", help="skip both perplexity measurements")
    parser.add_argument("--tasks", default="",
                        help="comma-separated lm-eval tasks: the bundled local ones ('local' = all of them) "
                             "or standard ones (lambada_openai, hellaswag, ...; need the hub)")
    add_report_options(parser)
    parser.add_argument("--ppl-rtol", type=tolerance, help="relative tolerance for perplexities (default by dtype)")
    parser.add_argument("--acc-atol", type=tolerance, help="absolute tolerance for accuracies (default by dtype)")
    parser.add_argument("--doc-ll-atol", type=tolerance,
                        help="tolerance for the max per-document |Δ loglikelihood| in nats (default by dtype)")
    add_progress_option(parser)
    add_eval_options(parser)
    parser.set_defaults(dtype="float32", batch_size=8, trust_remote_code=False, device="auto")


def _limit(value: float | None) -> int | float | None:
    from normswap.evaluation.lmeval import task_limit

    return task_limit(value, "--limit")


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> EvalSettings:
    """``EvalSettings`` from parsed ``eval`` arguments."""
    from normswap.evaluation.runner import EvalSettings, parse_dtype

    parse_dtype(args.dtype)  # fail early on a typo
    if args.batch_size is not None and args.batch_size < 1:
        raise NormswapError("--batch-size must be at least 1")
    check_threads(getattr(args, "threads", None))
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    values = dict(
        dtype=args.dtype, batch_size=args.batch_size, max_length=args.max_length, stride=args.stride,
        text=args.text, perplexity=not args.no_perplexity, tasks=tasks, limit=_limit(args.limit),
        device=resolve_device(args.device), device_map=args.device_map, trust_remote_code=bool(args.trust_remote_code),
        threads=getattr(args, "threads", None),
        share_contexts=not getattr(args, "plain_lm_eval", False),
        side_by_side=not getattr(args, "one_at_a_time", False),
        progress=not progress_off(args),
        audio=getattr(args, "audio", None), images=getattr(args, "images", None),
    )
    values.update(overrides)
    return EvalSettings(**values)


def tolerances_from_args(args: argparse.Namespace, dtype: str, base: Tolerances | None = None) -> Tolerances:
    """Default tolerances for the dtype (or ``base``), overridden by any --*-tol options given."""
    from normswap.evaluation.compare import default_tolerances

    tol = base or default_tolerances(dtype)
    for name in ("ppl_rtol", "acc_atol", "doc_ll_atol"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(tol, name, value)
    return tol


def check_threads(threads: int | None) -> None:
    """--threads: at least 1, and no more than 4 times the CPUs (torch's pools fail beyond)."""
    if threads is None:
        return
    limit = 4 * (os.cpu_count() or 1)
    if not 1 <= threads <= limit:
        raise NormswapError(f"--threads must be between 1 and {limit} (4 times this machine's CPUs), not {threads}")


def finish(args: argparse.Namespace, report: dict, *, out: Path | None, inputs: list[Path]) -> int:
    """Print the Markdown (or, with --json, the report), write the files, and map the verdict to the exit status.

    The files go to ``out`` as every normswap output does (``normswap.commands.write_reports``)."""
    from normswap.evaluation.report import to_markdown, write_report

    print(to_markdown(report))
    if out is not None:
        write_reports(out, lambda folder: list(write_report(report, folder, plot=args.plot).values()),
                      inputs=inputs, overwrite=args.overwrite)
    if args.json:
        emit_json(args, report)
    if report.get("verdict") == "fail":
        print("normswap: FAIL: the converted model differs from the original beyond tolerance", file=sys.stderr)
        return VerificationError.exit_code
    return 0


def run(args: argparse.Namespace) -> int:
    from normswap.extras import require

    quiet_progress_bars(args)
    require("eval", "normswap eval")
    inputs = command_inputs(args)
    check_report_out(args, inputs)  # before any work
    if args.no_perplexity and not args.tasks and not (args.audio or args.images):
        raise NormswapError("nothing to evaluate: --no-perplexity and no --tasks")
    for src in (args.model, args.baseline):
        if src is not None:
            check_source(src, trust_remote_code=bool(args.trust_remote_code))
    from normswap.evaluation.api import evaluate

    settings = settings_from_args(args)
    tolerances = tolerances_from_args(args, settings.dtype) if args.baseline else None
    report = evaluate(args.model, baseline=args.baseline, settings=settings, tolerances=tolerances)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under accelerate launch only the main process reports
    return finish(args, report, out=args.out, inputs=inputs)
