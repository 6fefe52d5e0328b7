"""``normswap verify ORIG CONVERTED``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from normswap.commands import check_source
from normswap.errors import NormswapError, VerificationError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("original", help="the original checkpoint (hub id or directory)")
    parser.add_argument("converted", help="the converted checkpoint directory")
    parser.add_argument("--atol", type=float, help="tolerance on max |Δ| (default by dtype)")
    parser.add_argument("--rtol", type=float, help="relative part of the tolerance, times max |output|")
    parser.add_argument("--json", help="also write the figures to this JSON file")
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
    from normswap.verify.checkpoint import verify_checkpoint
    from normswap.verify.compare import format_table

    result = verify_checkpoint(args.original, args.converted, atol=args.atol, rtol=args.rtol,
                               layerwise=args.layerwise, quiet=args.quiet, trust_remote_code=args.trust_remote_code)
    print(format_table(result["loaders"]))
    print(describe_mode(result))
    print(f"probe: {result['probe']} {result['probe_shape']}, tolerance {result['tolerance']['limit']:.3g}")
    if args.json:
        write_json_file(args.json, result)
    if not result["passed"]:
        raise VerificationError("the converted model does not match the original within tolerance")
    print("verified: outputs match")
    return 0


def describe_mode(result: dict) -> str:
    """One line on how a verification result was obtained, naming the worst layer when per-block."""
    if result.get("mode") != "layerwise":
        return "compared whole models" + (f"; {result['note']}" if result.get("note") else "")
    worst = result["worst_layer"]
    return (f"compared layer by layer; worst block: {worst['layer']} ({worst['loader']} loader, own max |Δ| = "
            f"{worst['block_max_abs_diff']:.3g}, {worst['relative']:.3g} of the stream's max |h|)")


def write_json_file(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file beside it, then a rename);
    a failure is one line."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.normswap-tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as file:
            json.dump(data, file, indent=2)
        os.replace(tmp, target)
    except OSError as error:
        from normswap.output import describe_os_error

        raise NormswapError(describe_os_error(error, f"while writing --json {path}")) from None
    finally:
        tmp.unlink(missing_ok=True)
