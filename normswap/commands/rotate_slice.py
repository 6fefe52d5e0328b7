"""``normswap rotate SRC --out DIR --slice FRACTION --calibration TEXT [--held-out TEXT] [--json]``."""

from __future__ import annotations

import argparse

from normswap.commands import emit_json
from normswap.errors import NormswapError


def check_options(args: argparse.Namespace) -> None:
    """Refuse the rotate options that mean nothing for a sliced checkpoint."""
    if args.slice is None:
        raise NormswapError("--held-out is only used with --slice")
    if args.method not in (None, "pca"):
        raise NormswapError(f"--slice deletes the least-variance directions of the stream's principal basis; it cannot "
                            f"use --method {args.method} (leave --method out, or give pca)")
    if args.verification not in ("auto", "none") or args.atol is not None or args.rtol is not None:
        raise NormswapError("a sliced model is not exact, so it has no tolerance to verify against; --slice reports "
                            "its perplexity cost instead (drop --verify, --atol and --rtol)")


def run_slice(args: argparse.Namespace) -> int:
    from normswap.rotate.slice_pipeline import SliceOptions, slice_checkpoint
    from normswap.verify.proof import WrittenProof

    check_options(args)
    options = SliceOptions(args.slice, args.calibration, args.held_out, args.calibration_tokens, args.dtype)
    provenance = slice_checkpoint(args.src, args.out, options, overwrite=args.overwrite,
                                  trust_remote_code=args.trust_remote_code,
                                  prover=None if args.verification == "none" else WrittenProof)
    block = provenance["slicing"]
    cost = block["perplexity"]
    print(f"wrote {args.out}: residual stream sliced from {block['original_hidden_size']} to {block['hidden_size']} "
          f"dimensions (fraction {block['fraction']}), {len(block['branches'])} shortcut matrices per block; "
          f"{block['energy_kept']['mean']:.2%} of the stream's energy kept on average "
          f"(min {block['energy_kept']['min']:.2%})")
    print(f"NOT exact: perplexity on {cost['tokens']} held-out tokens {cost['original']:.4f} (original) -> "
          f"{cost['sliced']:.4f} (sliced), {cost['increase']:+.2%}")
    if args.json:
        emit_json(args, provenance)
    return 0
