"""``normswap convert SRC --out DIR [--json]``."""

from __future__ import annotations

import argparse
import sys

from normswap.commands import (
    add_checkpoint_out,
    add_json_option,
    add_progress_option,
    add_verification_options,
    check_source,
    emit_json,
    non_empty,
    progress_off,
)
from normswap.text import count, format_table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="hub id (gpt2), local checkpoint directory, or normswap:austen-gpt2")
    parser.add_argument("--revision", type=non_empty, help="hub ids: the branch, tag or commit to download (default: main)")
    add_checkpoint_out(parser)
    parser.add_argument("--fold-gains", action="store_true",
                        help="fold each norm's gain and bias into the layers that read it (the input to normswap "
                             "rotate; unrotated, its weights quantise worse: docs/rotation.md)")
    parser.add_argument("--method", choices=["exact", "naive"], default="exact",
                        help="exact: centre the residual writers (default); naive: swap only (inexact)")
    parser.add_argument("--allow-inexact", action="store_true", help="required with --method naive")
    parser.add_argument("--dtype", help="output dtype (float32, float16, bfloat16, float64); default: the source's")
    add_verification_options(parser)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="no effect: conversion and its verification never run code from a checkpoint "
                             "(only families transformers implements are converted)")
    add_progress_option(parser)
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    check_source(args.src, trust_remote_code=args.trust_remote_code)
    from normswap.api import convert_checkpoint
    from normswap.commands.verify import describe_verification

    provenance = convert_checkpoint(
        args.src, args.out,
        fold_gains=args.fold_gains, method=args.method, dtype=args.dtype, overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code, atol=args.atol, rtol=args.rtol,
        allow_inexact=args.allow_inexact, quiet=progress_off(args),
        verification=args.verification, revision=args.revision,
    )
    print(f"wrote {args.out}: {count(len(provenance['norms_swapped']), 'norm')} swapped to RMSNorm, "
          f"{count(provenance['writers_centred'], 'writer')} centred, {count(len(provenance['norms_folded']), 'norm')} folded")
    verification = provenance.get("verification")
    if verification:
        print(format_table(verification["loaders"]))
        print(describe_verification(verification))
        if args.method == "naive":
            print("warning: --method naive is inexact by design; the figures above are its measured degradation",
                  file=sys.stderr)
    if provenance["norms_folded"]:
        print(FOLDING_TRAP, file=sys.stderr)
    if args.json:
        emit_json(args, provenance)
    return 0


FOLDING_TRAP = (
    "warning: folding each γ into the layers that read it scales their input columns by γ, so a few columns "
    "become outliers: per-channel low-bit weight quantisation (int4 round-to-nearest) of this checkpoint "
    "without a rotation can cost far more than it costs the original. Rotate it first (normswap rotate), or "
    "quantise in groups; docs/rotation.md has the measurements")
