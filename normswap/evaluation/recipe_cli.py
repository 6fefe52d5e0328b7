"""``normswap run RECIPE``: convert → verify → eval → report into one output folder.

The folder holds ``converted/`` (the checkpoint), ``conversion.json`` (its provenance and
verification figures), ``recipe.yaml`` (a copy), ``report.json``, ``report.md`` and, with ``--plot``, ``report.png``.
Command-line evaluation options override the recipe's. Exit status: 0 pass, 3 verification or
comparison failure, 2 user error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from normswap.commands import add_progress_option, add_report_options, check_source, quiet_progress_bars
from normswap.evaluation.cli import add_eval_options, finish, settings_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML file, or the name of a bundled one (e.g. austen-gpt2)")
    add_report_options(parser, out_help="the run's folder (default: runs/<recipe name>): absent or empty, "
                                         "or with --overwrite one that normswap wrote")
    add_progress_option(parser)
    add_eval_options(parser)


def _merged_settings(recipe, args: argparse.Namespace, trust_remote_code: bool = False):
    """Recipe eval settings, overridden by the command-line options that were given."""
    from normswap.evaluation.runner import EvalSettings

    base = EvalSettings(**{k: v for k, v in recipe.eval.items() if k != "limit" and v is not None})
    limit = recipe.eval.get("limit")
    merged = argparse.Namespace(
        dtype=args.dtype or base.dtype,
        batch_size=args.batch_size or base.batch_size,
        max_length=args.max_length or base.max_length,
        stride=base.stride,
        text=base.text,
        no_perplexity=not base.perplexity,
        tasks=",".join(base.tasks),
        limit=args.limit if args.limit is not None else limit,
        device=args.device or base.device,
        device_map=args.device_map or base.device_map,
        trust_remote_code=trust_remote_code,
        no_progress=args.no_progress,
        audio=args.audio or base.audio,
        images=args.images or base.images,
        threads=args.threads if args.threads is not None else base.threads,
        plain_lm_eval=bool(args.plain_lm_eval),
        one_at_a_time=bool(args.one_at_a_time),
    )
    return settings_from_args(merged)


def run(args: argparse.Namespace) -> int:
    from normswap.evaluation.recipe import load_recipe, permitted, run_recipe
    from normswap.extras import require

    quiet_progress_bars(args)
    require("eval", "normswap run")
    recipe = load_recipe(args.recipe)  # a bad recipe or source is refused before torch is imported
    trust = permitted(recipe, {"--trust-remote-code": bool(args.trust_remote_code)})["trust_remote_code"]
    check_source(recipe.source, trust_remote_code=trust)
    from normswap.evaluation.compare import Tolerances, default_tolerances

    settings = _merged_settings(recipe, args, trust)
    tolerances = Tolerances(**{**default_tolerances(settings.dtype).as_dict(), **recipe.tolerances})
    out = args.out or Path("runs") / recipe.name
    report = run_recipe(
        recipe, out, settings=settings, tolerances=tolerances, overwrite=args.overwrite,
        plot=args.plot, log=lambda message: print(message, file=sys.stderr),
    )
    # run_recipe wrote the files; finish() prints the Markdown (or JSON) and maps the verdict.
    return finish(args, report, out=None, inputs=[])
