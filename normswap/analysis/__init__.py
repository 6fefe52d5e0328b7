"""Geometry of the all-ones direction at every norm's input (``normswap geometry``).

* ``stats``   pure float64 statistics (cos θ to 1, mean share, RMS/std, naive-swap error, mean dims);
* ``collect`` forward pre-hooks that feed every norm's input to those statistics;
* ``report``  position dependence, dominant dimensions, text tables;
* ``plot``    the PNG; ``cli`` the command.


Names are imported lazily so that building the command line does not import torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# The text measured when none is given: an excerpt of Persuasion shipped with the package.
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "text" / "persuasion-excerpt.txt"

_EXPORTS = {
    "find_norms": "normswap.analysis.collect",
    "run_geometry": "normswap.analysis.collect",
    "build_report": "normswap.analysis.report",
    "format_comparison": "normswap.analysis.report",
    "format_report": "normswap.analysis.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'normswap.analysis' has no attribute {name!r}")
