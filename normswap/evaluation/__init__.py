"""Evaluation: strided perplexity, lm-eval tasks, side-by-side comparison, recipes.

``normswap eval`` lives in ``cli.py``, ``normswap run`` in ``recipe_cli.py``; the Python entry point
is ``normswap.evaluation.evaluate``. docs/evaluation.md has single-GPU, CPU, data-parallel and
``device_map="auto"`` commands.

Names are imported lazily so that building the command line does not import torch and lm-eval.
"""

from __future__ import annotations

from normswap.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "normswap.evaluation.api": ("evaluate",), "normswap.evaluation.runner": ("EvalSettings",),
    "normswap.evaluation.compare": ("Tolerances", "default_tolerances"),
    "normswap.evaluation.perplexity": ("strided_perplexity", "StridedResult"),
    "normswap.evaluation.recipe": ("load_recipe", "run_recipe"),
})
