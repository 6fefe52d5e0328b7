"""The core subcommands and the options every command shares.

- ``convert``: ``normswap convert``.
- ``inspect``: ``normswap inspect``, the conversion plan; writes nothing.
- ``rotate``: ``normswap rotate``.
- ``rotate_slice``: ``normswap rotate --slice``.
- ``verify``: ``normswap verify``.

Command modules import only the standard library at module level: the parser is built, and bad
paths are refused, before torch and transformers are imported.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from normswap.errors import NormswapError
from normswap.text import json_safe, json_text

__all__ = ["json_safe", "json_text"]  # the JSON every command prints


def check_source(src: str, *, trust_remote_code: bool = False) -> None:
    """Refuse, with one line, a ``src`` that is neither a checkpoint directory nor a hub id.

    A hub id is not fetched here: the command fetches it once, when it needs it.
    """
    from normswap.checkpoint.source import _HUB_ID, EXAMPLE_MODEL, resolve_source

    if src == EXAMPLE_MODEL or Path(src).expanduser().exists() or not _HUB_ID.match(src):
        resolve_source(src, trust_remote_code=trust_remote_code)


def check_device(name: str | None) -> None:
    """Refuse, with one line, a ``--device`` that torch cannot use here (``auto`` always works)."""
    if name in (None, "auto"):
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise NormswapError(f"--device {name!r} is not a torch device (auto, cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise NormswapError(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise NormswapError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise NormswapError(f"--device {name}: MPS is not available on this machine")


DEVICE_HELP = "torch device: auto (default: cuda when available, else cpu), cpu, cuda, cuda:1, mps"


def add_device_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = "auto") -> None:
    """``--device``, the same everywhere: ``auto`` is cuda when available, else cpu."""
    parser.add_argument("--device", default=default, help=DEVICE_HELP)


def resolve_device(name: str | None) -> str:
    """The torch device ``--device`` names; ``auto`` (or None) is cuda when available, else cpu."""
    if name in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name)
    return name


def at_least(low: int, high: int | None = None):
    """An argparse type: an integer >= ``low`` (a batch size, a length, a count), and <= ``high``
    when given (a seed torch must fit in 64 bits, a count that must fit in memory)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer, not {text!r:.30}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, not {value:.3g}")
        return value

    return parse


def non_empty(text: str) -> str:
    """An option value that names something: an empty string is refused, not read as '.' or 'main'."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def folder(text: str) -> Path:
    return Path(non_empty(text))


def add_checkpoint_out(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` (required) and ``--overwrite`` for the commands that write a checkpoint."""
    parser.add_argument("--out", required=True, metavar="DIR", type=non_empty,
                        help="output checkpoint folder: absent or empty, or with --overwrite one that normswap wrote")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --out that normswap wrote earlier (never any other folder)")


def tolerance(text: str) -> float:
    """An ``--atol``/``--rtol`` value: a finite number >= 0 (``--verify none`` turns checking off)."""

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tolerance is a number, not {text!r:.30}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a tolerance is a finite number >= 0, not {text!r:.30}")
    return value


def add_tolerance_options(parser: argparse.ArgumentParser, what: str = "logit") -> None:
    """``--atol`` and ``--rtol``, the same in ``convert``, ``rotate`` and ``verify``."""
    parser.add_argument("--atol", type=tolerance, help=f"verification tolerance on max |Δ{what}| (default by dtype)")
    parser.add_argument("--rtol", type=tolerance, help=f"relative part of the tolerance, times max |{what}|")


VERIFY_MODES = ("auto", "layerwise", "full")
VERIFY_HELP = ("layerwise: block by block within bounded memory; full: whole models; "
               "auto (default): layerwise for models above 1 GiB of float32 weights")


def add_verification_options(parser: argparse.ArgumentParser) -> None:
    """The built-in verification's options, shared by ``convert`` and ``rotate``."""
    add_tolerance_options(parser)
    parser.add_argument("--verify", dest="verification", choices=[*VERIFY_MODES, "none"], default="auto",
                        help=VERIFY_HELP + "; none: write without checking")


def add_verify_mode_option(parser: argparse.ArgumentParser) -> None:
    """``verify``'s ``--verify {auto,layerwise,full}``, the same choices as convert's and rotate's
    (``none`` aside: checking is the command); ``--layerwise`` and ``--full`` stay as hidden aliases."""
    parser.add_argument("--verify", dest="verification", choices=VERIFY_MODES, default="auto", help=VERIFY_HELP)
    parser.add_argument("--layerwise", dest="verification", action="store_const", const="layerwise",
                        help=argparse.SUPPRESS)
    parser.add_argument("--full", dest="verification", action="store_const", const="full", help=argparse.SUPPRESS)


def add_progress_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-progress``, the same in every command (``--quiet`` is a hidden alias). Bars are also
    off whenever stderr is not a terminal, and with ``HF_HUB_DISABLE_PROGRESS_BARS=1`` or ``TQDM_DISABLE=1``."""
    parser.add_argument("--no-progress", dest="no_progress", action="store_true",
                        help="no progress bars (also off when stderr is not a terminal)")
    parser.add_argument("--quiet", dest="no_progress", action="store_true", help=argparse.SUPPRESS)


def progress_off(args: argparse.Namespace) -> bool:
    """Whether progress bars stay off: ``--no-progress``, a stderr that is not a terminal, or the
    environment switches Hugging Face and tqdm users already set."""
    import os

    environment = any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
                      for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"))
    return bool(getattr(args, "no_progress", False)) or environment or not sys.stderr.isatty()


def quiet_progress_bars(args: argparse.Namespace) -> None:
    """When ``progress_off``, turn off the bars of the libraries normswap drives too (datasets,
    lm-eval's task building, transformers' loading). tqdm reads ``TQDM_DISABLE`` when it is
    imported, so this runs before anything imports it."""
    if progress_off(args):
        import os

        os.environ["TQDM_DISABLE"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``, the same everywhere: stdout carries only the JSON; the usual text goes to stderr."""
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON on stdout (the usual text goes to stderr)")


def add_report_options(parser: argparse.ArgumentParser, *, plot: bool = True, out_help: str | None = None) -> None:
    """``--out DIR`` for report.json and report.md (and plots with ``--plot``), ``--overwrite``, ``--json``."""
    parser.add_argument("--out", type=folder, metavar="DIR",
                        help=out_help or "write report.json and report.md here: a folder that is absent or empty, "
                                         "or with --overwrite one that normswap wrote")
    parser.add_argument("--overwrite", action="store_true", help="replace an --out folder that normswap wrote")
    if plot:
        parser.add_argument("--plot", action="store_true", help="also write plots (PNG) into --out")
    add_json_option(parser)


# Every option through which a command reads a file or folder: --out may overlap none of them.
INPUT_OPTIONS = ("src", "model", "baseline", "compare", "original", "converted", "text", "audio", "images",
                 "calibration", "held_out", "recipe")


def local_inputs(*sources: str | Path | None) -> list[Path]:
    """The local paths among a command's inputs, with the real files behind a folder's links (a
    hub cache's blobs): ``--out`` may not overlap them."""
    from normswap.checkpoint.source import source_inputs

    found: list[Path] = []
    for src in sources:
        path = Path(src).expanduser() if src is not None else None
        if path is not None and (path.exists() or path.is_symlink()):
            found += source_inputs(path) if path.is_dir() else [path]
    return found


def command_inputs(args: argparse.Namespace) -> list[Path]:
    """Every local input a command's arguments name (``INPUT_OPTIONS``)."""
    return local_inputs(*(getattr(args, name, None) for name in INPUT_OPTIONS))


def check_report_out(args: argparse.Namespace, inputs: list[Path], kind: str = "report") -> None:
    """Refuse, before any work, an ``--out`` normswap may not write, and ``--plot`` without one."""
    if getattr(args, "plot", False) and args.out is None:
        raise NormswapError("--plot needs --out DIR (the plots are written there)")
    if args.out is not None:
        from normswap.checkpoint import output

        args.out = output.absolute(args.out)
        output.check_out(args.out, inputs, args.overwrite, kind=kind)


def write_reports(out: Path, write: Callable[[Path], list[Path]], *, inputs: list[Path],
                  overwrite: bool, kind: str = "report") -> list[Path]:
    """Claim ``out``, let ``write(folder)`` fill a temporary folder, install it whole; the final paths.

    Like every normswap output (``normswap.checkpoint.output``): nothing half-written, and ``overwrite`` only
    replaces a folder normswap wrote."""
    from normswap.checkpoint import output

    with output.claimed_output(out, inputs=inputs, overwrite=overwrite, kind=kind) as claim:
        names = [path.name for path in write(claim.tmp)]
        claim.install()
    paths = [out / name for name in names]
    print("wrote " + ", ".join(str(path) for path in paths), file=sys.stderr)
    return paths


def emit_json(args: argparse.Namespace, data: Any) -> None:
    """Print ``data`` as JSON to the real stdout (``normswap.cli`` sends all other text to stderr)."""
    stream = getattr(args, "json_stream", None) or sys.stdout
    stream.write(json_text(data))
    stream.flush()
