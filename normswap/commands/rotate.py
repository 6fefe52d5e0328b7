"""``normswap rotate SRC --out DIR [--method hadamard|orthogonal|pca] [--seed N] [--calibration TEXT]
[--slice FRACTION [--held-out TEXT]] [--json]``."""

from __future__ import annotations

import argparse

from normswap.commands import add_checkpoint_out, add_json_option, add_verification_options, emit_json

METHODS = ("hadamard", "orthogonal", "pca")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="an original LayerNorm checkpoint (hub id, directory, normswap:austen-gpt2) "
                                    "or a normswap checkpoint converted with --fold-gains")
    add_checkpoint_out(parser)
    parser.add_argument("--method", choices=METHODS,
                        help="hadamard: randomised Hadamard diag(±1)·H/√d (default); orthogonal: seeded random "
                             "orthogonal; pca: principal directions of the stream on --calibration text "
                             "(the default, and the only method, with --slice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random signs / random matrix (default 0)")
    parser.add_argument("--calibration", metavar="TEXT_FILE", help="UTF-8 text the pca directions are measured on")
    parser.add_argument("--calibration-tokens", type=int, default=32768,
                        help="use at most this many calibration tokens (default 32768)")
    parser.add_argument("--slice", type=float, metavar="FRACTION",
                        help="delete this share (0 < f < 1) of the stream's dimensions, the least-variance principal "
                             "directions at every norm input (SliceGPT); needs --calibration. NOT exact: the "
                             "perplexity cost on held-out text is measured and reported")
    parser.add_argument("--held-out", metavar="TEXT_FILE",
                        help="with --slice: text the perplexity cost is measured on (default: the last 10%% of the "
                             "calibration text's tokens, then not used for calibration)")
    parser.add_argument("--dtype", help="output dtype (float32, float16, bfloat16, float64); default: the source's")
    add_verification_options(parser)
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the source's own code to run")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    if args.slice is not None or args.held_out is not None:
        from normswap.commands.rotate_slice import run_slice

        return run_slice(args)
    from normswap.api import rotate_checkpoint
    from normswap.commands.verify import describe_mode
    from normswap.text import format_table

    provenance = rotate_checkpoint(
        args.src, args.out, method=args.method or "hadamard", seed=args.seed, calibration=args.calibration,
        calibration_tokens=args.calibration_tokens, dtype=args.dtype, overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code, atol=args.atol, rtol=args.rtol,
        verification=args.verification, quiet=args.quiet,
    )
    rotation = provenance["rotation"]
    counts = rotation["rotated"]
    seed = "" if rotation["seed"] is None else f" (seed {rotation['seed']})"
    print(f"wrote {args.out}: residual stream rotated by {rotation['method']}{seed}, d = {rotation['dimension']}, "
          f"sha256 {rotation['matrix_sha256'][:16]}…; {counts['writers']} writers, {counts['readers']} readers, "
          f"{counts['norm_biases']} norm biases rotated")
    verification = provenance.get("verification")
    if verification:
        print(format_table(verification["loaders"]))
        print(describe_mode(verification))
    if args.json:
        emit_json(args, provenance)
    return 0
