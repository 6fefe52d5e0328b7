"""``normswap rotate SRC --out DIR [--method hadamard|orthogonal|pca] [--seed N] [--calibration TEXT]
[--slice FRACTION [--held-out TEXT]] [--json]``."""

from __future__ import annotations

import argparse

from normswap.checkpoint.rotations import (
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_METHOD,
    ROTATION_FORMS,
    ROTATION_METHODS,
)
from normswap.commands import (
    add_checkpoint_out,
    add_json_option,
    add_progress_option,
    add_verification_options,
    emit_json,
    progress_off,
)
from normswap.errors import NormswapError
from normswap.text import count, format_table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="an original LayerNorm checkpoint (hub id, directory, normswap:austen-gpt2) "
                                    "or a normswap checkpoint converted with --fold-gains")
    add_checkpoint_out(parser)
    parser.add_argument("--method", choices=list(ROTATION_METHODS),
                        help="; ".join(f"{name}: {method.help}" for name, method in ROTATION_METHODS.items()))
    parser.add_argument("--form", choices=ROTATION_FORMS,
                        help="commuting (default): Q·1 = 1, so LayerNorm(x·Q) = LayerNorm(x)·Q and the output keeps the "
                             "original model type, loadable by stock transformers; free: any orthogonal Q on the "
                             "centred RMSNorm conversion, written as a normswap_<type> checkpoint")
    parser.add_argument("--online-hadamard", action="store_true",
                        help="with --form free: also turn every MLP down projection's input by a Hadamard matrix at run "
                             "time (QuaRot's online Hadamard), its weight stored with H folded in; exact, and not "
                             "foldable into any weight, so the stock class cannot hold it")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random signs / random matrix (default 0)")
    parser.add_argument("--calibration", metavar="PATH",
                        help="what the pca directions are measured on, of the model's kind, or 'bundled' for the "
                             "samples that ship with normswap: UTF-8 text (language models, CLIP's text tower; "
                             "bundled: held-out Persuasion), transcribed audio for Whisper (a folder of audio files "
                             "with .txt transcripts or a JSONL manifest, as --audio), images for ViT (as --images)")
    parser.add_argument("--calibration-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS,
                        help=f"use at most this many calibration tokens (default {DEFAULT_CALIBRATION_TOKENS})")
    parser.add_argument("--slice", type=float, metavar="FRACTION",
                        help="delete this share (0 < f < 1) of the stream's dimensions, the least-variance principal "
                             "directions at every norm input (SliceGPT); needs --calibration. NOT exact: the "
                             "perplexity cost on held-out text is measured and reported")
    parser.add_argument("--held-out", metavar="TEXT_FILE",
                        help="with --slice: text the perplexity cost is measured on, or 'bundled' (default: the last 10%% of the "
                             "calibration text's tokens, then not used for calibration)")
    parser.add_argument("--dtype", help="output dtype (float32, float16, bfloat16, float64); default: the source's")
    add_verification_options(parser)
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the source's own code to run")
    add_progress_option(parser)
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    from normswap.evaluation.text import text_file

    if args.slice is not None or args.held_out is not None:
        for name in ("calibration", "held_out"):  # 'bundled' names the bundled text, as --text does elsewhere
            if getattr(args, name) is not None:
                setattr(args, name, str(text_file(getattr(args, name))))
        from normswap.commands.rotate_slice import run_slice

        if args.form is not None or args.online_hadamard:
            raise NormswapError(f"{'--form' if args.form is not None else '--online-hadamard'} applies to rotation; a "
                                "sliced checkpoint has its own model type (docs/rotation.md says why)")

        return run_slice(args)
    from normswap.api import rotate_checkpoint
    from normswap.commands.verify import describe_verification

    provenance = rotate_checkpoint(
        args.src, args.out, method=args.method or DEFAULT_METHOD, seed=args.seed, form=args.form or "commuting",
        calibration=args.calibration,
        calibration_tokens=args.calibration_tokens, dtype=args.dtype, overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code, atol=args.atol, rtol=args.rtol,
        verification=args.verification, quiet=progress_off(args), online_hadamard=args.online_hadamard,
    )
    rotation = provenance["rotation"]
    counts = rotation["rotated"]
    seed = "" if rotation["seed"] is None else f" (seed {rotation['seed']})"
    form = ("commuting form: Q·1 = 1, the original model type, loadable by stock transformers"
            if rotation.get("form") == "commuting" else "free form: model type normswap_<type>")
    print(f"wrote {args.out}: residual stream rotated by {rotation['method']}{seed}, d = {rotation['dimension']}, "
          f"sha256 {rotation['matrix_sha256'][:16]}…; {count(counts['writers'], 'writer')}, "
          f"{count(counts['readers'], 'reader')}, {count(counts['norm_biases'], 'norm bias')} rotated ({form})")
    calibration = rotation.get("calibration")
    if calibration:
        source = next(calibration[key] for key in ("text", "audio", "images") if key in calibration)
        print(f"pca calibrated on {source}: {count(calibration['tokens'], 'stream position')} at "
              f"{count(calibration['norms'], 'norm input')} ({calibration['mode']})")
    online = rotation.get("online_hadamard")
    if online:
        print(f"online Hadamard of order {online['size']} ({online['construction']}) at the input of "
              f"{count(len(online['modules']), 'MLP down projection')}, applied at run time")
    for stream in rotation.get("fixed_streams", {}).values():
        print(f"not rotated: {stream}")
    for name, norm in rotation.get("rotated_outputs", {}).items():
        print(f"rotated output: {name} (the output of {norm}, γ and β folded away, times Q)")
    verification = provenance.get("verification")
    if verification:
        print(format_table(verification["loaders"]))
        print(describe_verification(verification))
    if args.json:
        emit_json(args, provenance)
    return 0
