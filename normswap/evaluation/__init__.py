"""Evaluation: strided perplexity, lm-eval tasks, side-by-side comparison, recipes.

- ``api``: one call for the whole evaluation (``normswap.evaluation.evaluate``).
- ``cli``: ``normswap eval``; ``recipe_cli``: ``normswap run``; ``recipe``: the recipe files.
- ``runner``: models evaluated under identical settings; ``perplexity``: the strided perplexity.
- ``lmeval``: lm-eval tasks and runs; ``local_tasks``: the bundled tasks; ``shared_context``: the
  shared-context ``HFLM``; ``task_code`` and ``task_schema``: a task folder checked before lm-eval reads it.
- ``text``: text sources; ``hub``: whether the hub is reachable.
- ``media``: image inputs and which model reads which; ``media_eval``: speech and vision evaluation;
  ``audio``: transcribed audio; ``speech``: Whisper's scores; ``vision``: image models' scores;
  ``calibration``: calibration inputs of the models that do not read text.
- ``compare``: deltas and a verdict; ``report``: the report; ``plot``: its chart.

docs/evaluation.md has single-GPU, CPU, data-parallel and ``device_map="auto"`` commands. Names
are imported lazily so that building the command line does not import torch and lm-eval.
"""

from __future__ import annotations

from normswap.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "normswap.evaluation.api": ("evaluate",), "normswap.evaluation.runner": ("EvalSettings",),
    "normswap.evaluation.compare": ("Tolerances", "default_tolerances"),
    "normswap.evaluation.perplexity": ("strided_perplexity", "StridedResult"),
    "normswap.evaluation.recipe": ("load_recipe", "run_recipe"),
})
