"""Evaluation: strided perplexity, lm-eval tasks, side-by-side comparison, recipes.

``normswap eval`` lives in ``cli.py``, ``normswap run`` in ``recipe_cli.py``; the Python entry point
is ``normswap.evaluation.evaluate``. docs/evaluation.md has single-GPU, CPU, data-parallel and
``device_map="auto"`` commands.

Names are imported lazily so that building the command line does not import torch and lm-eval.
"""

from __future__ import annotations

from normswap.lazy import lazy_getattr

_EXPORTS = {
    "evaluate": "normswap.evaluation.api",
    "EvalSettings": "normswap.evaluation.runner",
    "Tolerances": "normswap.evaluation.compare",
    "default_tolerances": "normswap.evaluation.compare",
    "strided_perplexity": "normswap.evaluation.perplexity",
    "StridedResult": "normswap.evaluation.perplexity",
    "load_recipe": "normswap.evaluation.recipe",
    "run_recipe": "normswap.evaluation.recipe",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
