"""``normswap verify ORIG CONVERTED [--out DIR] [--json]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from normswap.commands import (
    add_report_options,
    add_tolerance_options,
    check_report_out,
    check_source,
    emit_json,
    local_inputs,
)
from normswap.errors import VerificationError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("original", help="the original checkpoint (hub id or directory)")
    parser.add_argument("converted", help="the converted checkpoint directory")
    add_tolerance_options(parser, what="output")
    add_report_options(parser, plot=False)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--layerwise", action="store_const", const=True, dest="layerwise",
                      help="compare block by block within bounded memory (default above 1 GiB of float32 weights)")
    mode.add_argument("--full", action="store_const", const=False, dest="layerwise",
                      help="compare whole models (default for small models)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the converted checkpoint's own modeling_normswap.py instead of normswap's "
                             "installed copy of it (by default no code from either checkpoint runs)")


def run(args: argparse.Namespace) -> int:
    check_source(args.original)
    check_source(args.converted)
    inputs = local_inputs(args.original, args.converted)
    check_report_out(args, inputs)
    from normswap.verify.checkpoint import verify_checkpoint

    result = verify_checkpoint(args.original, args.converted, atol=args.atol, rtol=args.rtol,
                               layerwise=args.layerwise, quiet=args.quiet, trust_remote_code=args.trust_remote_code)
    text = summary(result)
    print(text)
    if args.out is not None:
        from normswap.commands import json_text, write_reports

        def write(folder: Path) -> list[Path]:
            files = {"report.json": json_text(result), "report.md": to_markdown(args, text)}
            for name, content in files.items():
                (folder / name).write_text(content, encoding="utf-8")
            return [folder / name for name in files]

        write_reports(args.out, write, inputs=inputs, overwrite=args.overwrite)
    if args.json:
        emit_json(args, result)
    if not result["passed"]:
        raise VerificationError(f"the converted model does not match the original within tolerance; {blame(result)}")
    return 0


def summary(result: dict) -> str:
    """The figures as text: one row per loader, the comparison mode, the probe, the verdict."""
    from normswap.text import format_table

    verdict = "verified: outputs match" if result["passed"] else "FAILED: outputs differ beyond tolerance"
    return "\n".join([
        format_table(result["loaders"]),
        describe_mode(result),
        f"probe: {result['probe']} {result['probe_shape']}, tolerance {result['tolerance']['limit']:.3g}",
        verdict,
    ])


def describe_mode(result: dict) -> str:
    """One line on how a verification result was obtained, naming the worst layer when per-block."""
    if result.get("mode") != "layerwise":
        return "compared whole models" + (f"; {result['note']}" if result.get("note") else "")
    worst = result["worst_layer"]
    if "block_max_abs_diff" in worst:
        return (f"compared layer by layer; worst block: {worst['layer']} ({worst['loader']} loader, own max |Δ| = "
                f"{worst['block_max_abs_diff']:.3g}, {worst['relative']:.3g} of the stream's max |h|)")
    return (f"compared layer by layer; worst block: {worst['layer']} ({worst['loader']} loader, stream max |Δ| "
            f"after it = {worst['max_abs_diff']:.3g}, {worst['relative']:.3g} of the stream's max |h|)")


def blame(result: dict) -> str:
    """Where a failed verification points: the worst block, or how to find it."""
    worst = result.get("worst_layer") if result.get("mode") == "layerwise" else None
    if not worst:
        return "rerun with --layerwise to name the block to blame"
    return f"worst block {worst['layer']} ({worst['loader']} loader)"


def to_markdown(args: argparse.Namespace, text: str) -> str:
    """report.md: what was compared, and the figures as printed."""
    return (f"# normswap verify\n\n- **original**: `{args.original}`\n- **converted**: `{args.converted}`\n\n"
            f"```\n{text}\n```\n")
