"""``normswap verify ORIG CONVERTED [--out DIR] [--json]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from normswap.commands import (
    add_progress_option,
    add_report_options,
    add_tolerance_options,
    add_verify_mode_option,
    check_report_out,
    check_source,
    command_inputs,
    emit_json,
    json_text,
    progress_off,
    write_reports,
)
from normswap.errors import VerificationError
from normswap.text import format_table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("original", help="the original checkpoint: hub id, local directory or normswap:austen-gpt2")
    parser.add_argument("converted", help="the converted checkpoint: local directory, hub id or a normswap: name")
    add_tolerance_options(parser, what="output")
    add_report_options(parser, plot=False)
    add_verify_mode_option(parser)
    add_progress_option(parser)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the converted checkpoint's own modeling_normswap.py instead of normswap's "
                             "installed copy of it (by default no code from either checkpoint runs)")


def run(args: argparse.Namespace) -> int:
    check_source(args.original)
    check_source(args.converted)
    inputs = command_inputs(args)
    check_report_out(args, inputs)
    from normswap.convert.install import LAYERWISE
    from normswap.verify.checkpoint import verify_checkpoint

    result = verify_checkpoint(args.original, args.converted, atol=args.atol, rtol=args.rtol,
                               layerwise=LAYERWISE[args.verification], quiet=progress_off(args),
                               trust_remote_code=args.trust_remote_code)
    text = summary(result)
    print(text)
    if args.out is not None:

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
    verdict = "verified: outputs match" if result["passed"] else "FAILED: outputs differ beyond tolerance"
    return "\n".join([
        format_table(result["loaders"]),
        describe_verification(result),
        f"probe: {result['probe']} {result['probe_shape']}, tolerance {result['tolerance']['limit']:.3g}",
        verdict,
    ])


def describe_verification(result: dict) -> str:
    """How a verification result was obtained: the weights proof, then the forward comparison."""
    return "\n".join(line for line in (describe_proof(result), describe_mode(result)) if line)


def describe_proof(result: dict) -> str:
    """One line on the weights proof: how many tensors, and the worst one in ulps of its dtype."""
    proof = result.get("proof")
    if not proof:
        return ""
    worst = proof["worst"]
    how = ("every computed tensor bit-exact to its correctly rounded value" if worst["tensor"] is None else
           f"worst: {worst['tensor']}, {worst['ulp']:.3g} ulp of {worst['dtype']} from its correctly rounded value "
           f"({worst['elements_off_by_rounding']} elements off by rounding)")
    return (f"weights proven: {proof['tensors']} tensors ({proof['byte_identical']} byte-identical to the source, "
            f"{proof['recomputed']} computed in float64); {how}")


def describe_mode(result: dict) -> str:
    """One line on how a verification result was obtained, naming the worst layer when per-block."""
    if result.get("mode") != "layerwise":
        return "compared whole models" + (f"; {result['note']}" if result.get("note") else "")
    worst = result["worst_layer"]
    blocks = result.get("blocks")
    how = ("compared layer by layer" if not blocks else
           f"compared blocks {', '.join(map(str, blocks['run']))} of {blocks['of']} layer by layer (the weights proof "
           "covers every block; --verify layerwise runs them all)")
    if "block_max_abs_diff" in worst:
        return (f"{how}; worst block: {worst['layer']} ({worst['loader']} loader, own max |Δ| = "
                f"{worst['block_max_abs_diff']:.3g}, {worst['relative']:.3g} of the stream's max |h|)")
    return (f"{how}; worst block: {worst['layer']} ({worst['loader']} loader, stream max |Δ| "
            f"after it = {worst['max_abs_diff']:.3g}, {worst['relative']:.3g} of the stream's max |h|)")


def blame(result: dict) -> str:
    """Where a failed verification points: the worst block, or how to find it."""
    worst = result.get("worst_layer") if result.get("mode") == "layerwise" else None
    if not worst:
        return "rerun with --verify layerwise to name the block to blame"
    return f"worst block {worst['layer']} ({worst['loader']} loader)"


def to_markdown(args: argparse.Namespace, text: str) -> str:
    """report.md: what was compared, and the figures as printed."""
    return (f"# normswap verify\n\n- **original**: `{args.original}`\n- **converted**: `{args.converted}`\n\n"
            f"```\n{text}\n```\n")
