"""Geometry of the all-ones direction at every norm's input (``normswap geometry``).

- ``stats``: pure float64 statistics (cos θ to 1, mean share, RMS/std, naive-swap error, mean dims).
- ``collect``: forward pre-hooks that feed every norm's input to those statistics, over real tokens.
- ``outliers``: activation outliers at the inputs of linear layers, and what a rotation changes.
- ``report``: position dependence, dominant dimensions, text tables.
- ``plot``: the PNG.
- ``cli``: the command.

Names are imported lazily so that building the command line does not import torch.
"""

from __future__ import annotations

from pathlib import Path

from normswap.lazy import lazy_exports

# The text measured when none is given: an excerpt of Persuasion shipped with the package.
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "text" / "persuasion-excerpt.txt"

__getattr__, __all__ = lazy_exports(__name__, {
    "normswap.analysis.collect": ("find_norms", "run_geometry"),
    "normswap.analysis.report": ("build_report", "format_comparison", "format_report"),
})
